"""Speculative decoding with prompt lookup (``--speculative-config '{"method": "ngram"}'``) on the
embedded SmolLM2: greedy output token for token equal to decoding without it, through chunked
prefill beside verification steps and preemption; seeded requests, logprobs, min_tokens,
penalties and structured outputs the same with drafts as without; limits and stop ids kept
inside an accepted run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from deepbatch import LLM, SamplingParams
from deepbatch.core.sampling_params import StructuredOutputsParams
from spec_steps_common import alternate_draft_steps

CODE = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n")
DOC = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin spans "
       "seven million square kilometres, of which five and a half million are covered by the "
       "rainforest. The region includes territory belonging to nine nations.")
PROMPTS = [
    CODE + "Rewrite both functions above with type hints:\n\n",
    f"Document: {DOC}\n\nQuestion: How many square kilometres does the basin span?\nAnswer, quoting the document:",
    f"Summarize in one sentence, reusing the document's words.\n\n{DOC}\n\nSummary:",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def spec_llm():
    # Small chunks and a small KV pool: prefill chunks share steps with verification, and the
    # four requests cannot all stay resident (preemption by recompute, drafts dropped with it).
    # Every proposed draft runs (no cost model), so the counts below depend on the tokens alone.
    return LLM(max_model_len=1024, dtype="float32", device="cpu", max_num_batched_tokens=48,
               num_gpu_blocks_override=16, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                               "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                                               "cost_model": False})


def same_tokens_with_drafts(spec_llm, smollm_llm, prompts, params):
    """The outputs without and with drafts, asserted token for token equal, some drafts accepted."""
    want = smollm_llm.generate(prompts, params, use_tqdm=False)
    accepted_before = spec_llm.engine.stats.spec_num_accepted_tokens
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert spec_llm.engine.stats.spec_num_accepted_tokens > accepted_before
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs], (g.outputs[0].text,
                                                                                      w.outputs[0].text)
    return want, got


def test_greedy_output_equals_decoding_without_drafts(spec_llm, smollm_llm):
    want = smollm_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine = spec_llm.engine
    engine.scheduler.num_preemptions = 0
    got = spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, (g.outputs[0].text, w.outputs[0].text)
        assert g.outputs[0].text == w.outputs[0].text
    stats = engine.stats
    print(f"\n{stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} drafts accepted in "
          f"{stats.spec_num_drafts} drafting request-steps; by position {stats.spec_accepted_per_position}; "
          f"{engine.scheduler.num_preemptions} preemptions")
    # The workload copies its prompts: drafts are made, many are right, and fewer steps run.
    assert stats.spec_num_accepted_tokens >= 20 and stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert engine.scheduler.num_preemptions > 0
    assert not engine.has_unfinished_requests() and engine.kv_cache.pool.num_free_blocks == engine.num_blocks


def test_the_cost_model_measures_each_step_and_output_is_unchanged(smollm_llm):
    # The default: a cap chosen per step from the engine's own step times (control/spec_cost.py).
    llm = LLM(max_model_len=1024, dtype="float32", device="cpu", speculative_config={"method": "ngram"})
    want = smollm_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    cost, stats = llm.engine.spec_cost, llm.engine.stats
    # Every step measured once: the plain ones by the step-time fit, the drafting ones for their cost.
    assert len(cost.fit.steps) + cost.num_drafting_steps == stats.num_steps
    assert cost.num_drafting_steps > 0 and len(cost.fit.steps) > 0 and stats.spec_num_drafts > 0
    assert sum(stats.spec_drafted_per_position) == stats.spec_num_draft_tokens
    assert cost.drafted[0] > 0 and cost.last_caps is not None


def test_the_counters_reach_the_metrics_with_vllms_names(spec_llm):
    from prometheus_client import CollectorRegistry, generate_latest

    from deepbatch.api.metrics import _EngineCollector, engine_stats
    from deepbatch.engine.snapshot import EngineSnapshot, take_snapshot

    spec_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    stats = spec_llm.engine.stats
    snap = take_snapshot(spec_llm.engine, EngineSnapshot())
    assert snap.spec_decode == (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
                                tuple(stats.spec_accepted_per_position))
    registry = CollectorRegistry()
    registry.register(_EngineCollector(SimpleNamespace(snapshot=lambda: snap), "m"))
    text = generate_latest(registry).decode()
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.spec_num_drafts)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(stats.spec_num_accepted_tokens)}' \
        in text
    first = stats.spec_accepted_per_position[0]
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(first)}' in text
    # GET /stats (and the dashboard's tile) carry the counters and the two derived figures.
    shown = engine_stats(snap)["spec_decode"]
    assert shown["num_accepted_tokens"] == stats.spec_num_accepted_tokens > 0
    assert shown["acceptance_rate"] == stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert shown["mean_acceptance_length"] == 1 + stats.spec_num_accepted_tokens / stats.spec_num_drafts
    assert engine_stats(EngineSnapshot())["spec_decode"] is None  # speculation off


def test_seeds_logprobs_and_min_tokens_draft_and_write_what_they_write_without_drafts(spec_llm, smollm_llm):
    # Every draft row is drawn as the request would draw at that output position: a seed's noise
    # and min_tokens' ban follow the position, so a seeded request keeps the same tokens.
    params = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, n=2),  # each choice its own stream
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20, logprobs=3, min_tokens=18),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20),
    ]
    want, got = same_tokens_with_drafts(spec_llm, smollm_llm, PROMPTS, params)
    for i in (1, 2):
        w, g = want[i].outputs[0].logprobs, got[i].outputs[0].logprobs
        assert len(g) == len(w) == len(got[i].outputs[0].token_ids)
        for wl, gl in zip(w, g):
            assert list(gl) == list(wl)
            assert all(gl[t].rank == wl[t].rank and gl[t].logprob == pytest.approx(wl[t].logprob, abs=1e-4)
                       for t in wl)


def test_penalised_requests_draft_and_write_what_they_write_without_drafts(spec_llm, smollm_llm):
    # Draft row j is penalised with the first j drafts counted; the counts keep the kept tokens.
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=24),
        SamplingParams(temperature=0.8, seed=7, frequency_penalty=0.4, presence_penalty=0.3, max_tokens=24),
        SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2, max_tokens=24),
        SamplingParams(temperature=0.0, presence_penalty=0.6, max_tokens=24),
    ]
    same_tokens_with_drafts(spec_llm, smollm_llm, PROMPTS, params)


def test_structured_outputs_draft_and_write_what_they_write_without_drafts(spec_llm, smollm_llm):
    # The grammar's matcher walks each request's drafts to mask its draft rows, then steps back.
    # The area's length capped: greedy SmolLM2 would go on quoting the whole document.
    schema = {"type": "object", "required": ["area", "nations"], "additionalProperties": False,
              "properties": {"area": {"type": "string", "maxLength": 60}, "nations": {"type": "integer"}}}
    question = (f"Document: {DOC}\n\nAs JSON with keys area (the basin's area, quoted from the document) "
                "and nations:")
    prompts = [question, question, PROMPTS[0], PROMPTS[1]]
    json_output = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=json_output),
        SamplingParams(temperature=0.7, seed=3, max_tokens=120, structured_outputs=json_output),
        SamplingParams(temperature=0.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex=r"def [a-z_]+\(width: int, height: int\)")),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    _, got = same_tokens_with_drafts(spec_llm, smollm_llm, prompts, params)
    for g in got[:2]:
        assert g.outputs[0].finish_reason == "stop", g.outputs[0].text
        jsonschema.validate(json.loads(g.outputs[0].text), schema)


def test_sampled_runs_keep_max_tokens_and_stop_ids(spec_llm):
    exact = SamplingParams(temperature=0.7, max_tokens=21, ignore_eos=True)
    outs = spec_llm.generate(PROMPTS, exact, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 21 and o.outputs[0].finish_reason == "length" for o in outs)
    # A stop id inside the copied text: the run ends at it, whatever was accepted after it.
    newline = spec_llm.engine.tokenizer.encode("\n")[-1]
    stop = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[newline])
    out = spec_llm.generate([PROMPTS[0]], stop, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == newline
    assert out.token_ids.count(newline) == 1 and out.token_ids[-1] == newline


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle"}, "not available yet"),
    ({"method": "mtp"}, "mtp needs a checkpoint with multi-token-prediction layers .* LlamaForCausalLM has none"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "draft": 1}, "unknown key"),
    ({"method": "ngram", "cost_model": "yes"}, "cost_model must be bool"),
    ('{"method": "ngram"', "not JSON"),
])
def test_a_bad_speculative_config_is_a_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=None, speculative_config=config)


def test_async_steps_without_drafts_and_synchronous_steps_with_them_mix(spec_llm, smollm_llm, monkeypatch):
    # Under async scheduling a step the cost model keeps free of drafts is launched before the
    # one in flight is committed; a step with drafts commits that one first and runs alone. Here
    # the two alternate, through seeds, penalties and a grammar.
    engine = spec_llm.engine
    choices = alternate_draft_steps(engine, monkeypatch)
    params = [
        SamplingParams(temperature=0.0, max_tokens=32),
        SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.2, max_tokens=32),
        SamplingParams(temperature=0.0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(regex=r"def [a-z_]+\(width: int, height: int\)")),
        SamplingParams(temperature=0.7, seed=9, max_tokens=32, logprobs=1),
    ]
    same_tokens_with_drafts(spec_llm, smollm_llm, PROMPTS, params)
    assert engine._inflight is None and True in choices and False in choices
