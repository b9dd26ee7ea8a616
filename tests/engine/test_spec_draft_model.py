"""Speculative decoding with a draft model (``{"method": "draft_model", "model": ...}``): output
token for token equal to decoding without drafts, whatever the draft proposes, through chunked
prefill, a draft catching up over long prompts a part per step, preemption, the cost model,
async scheduling and every sampling option; a draft with another vocabulary refused at start-up."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import jsonschema
import pytest

from deepbatch import LLM, SamplingParams
from deepbatch.core.sampling_params import StructuredOutputsParams
from spec_steps_common import alternate_draft_steps
from deepbatch.models.loader import default_model_path
from deepbatch.runner.draft_model_runner import check_vocabularies

rng = random.Random(3)
# Lengths up to 150 tokens: with 32-token steps the draft catches up over several steps.
PROMPTS = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (12, 40, 75, 150, 9, 64)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def tiny_llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=256, **kwargs)


def draft_config(draft: str, **kwargs) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, **kwargs}


def assert_same_tokens(want, got) -> None:
    for w, g in zip(want, got):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return tiny_llm(tiny_checkpoints["llama"])


def test_the_target_drafting_for_itself_has_every_draft_accepted(tiny_checkpoints, reference):
    # The same weights draft and verify: every greedy draft is the target's own next token. A
    # small pool preempts requests (their draft blocks return), and 32-token steps split both the
    # prompts and the draft's catch-up over them.
    target = tiny_checkpoints["llama"]
    llm = tiny_llm(target, max_num_batched_tokens=32, num_gpu_blocks_override=14,
                   speculative_config=draft_config(target, cost_model=False))
    want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_tokens(want, got)
    engine, stats = llm.engine, llm.engine.stats
    print(f"\n{stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} drafts accepted, "
          f"{stats.num_steps} steps, {engine.scheduler.num_preemptions} preemptions")
    assert stats.spec_num_draft_tokens >= 100
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert engine.scheduler.num_preemptions > 0
    proposer = engine.proposer
    assert not proposer.seqs and sorted(proposer.free_blocks) == list(range(engine.num_blocks))


def test_another_model_drafts_and_the_output_is_the_targets(tiny_checkpoints, reference):
    # A Qwen2 draft of other random weights: its drafts are rarely right, and never change what
    # the target writes. The cost model on, as by default.
    llm = tiny_llm(tiny_checkpoints["llama"], speculative_config=draft_config(tiny_checkpoints["qwen2"]))
    want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_tokens(want, got)
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert llm.engine.spec_cost.last_caps is not None


def test_sampling_options_write_what_they_write_without_drafts(tiny_checkpoints, reference, monkeypatch):
    # Seeds, penalties, logprobs, min_tokens and n=2, through async steps without drafts beside
    # synchronous drafting steps. The draft's greedy tokens are often what a peaky target samples.
    target = tiny_checkpoints["llama"]
    llm = tiny_llm(target, speculative_config=draft_config(target, cost_model=False))
    engine = llm.engine
    choices = alternate_draft_steps(engine, monkeypatch)
    params = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, n=2),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20, logprobs=3, min_tokens=18),
        SamplingParams(temperature=0.8, seed=7, frequency_penalty=0.4, presence_penalty=0.3, max_tokens=24),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=24),
        SamplingParams(temperature=0.7, seed=3, top_p=0.9, top_k=20, max_tokens=24),
    ]
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same_tokens(want, got)
    for i in (1, 2):
        for wl, gl in zip(want[i].outputs[0].logprobs, got[i].outputs[0].logprobs):
            assert list(gl) == list(wl)
            assert all(gl[t].logprob == pytest.approx(wl[t].logprob, abs=1e-4) for t in wl)
    assert engine.stats.spec_num_accepted_tokens > 20 and engine._inflight is None
    assert True in choices and False in choices


def test_sampled_drafts_are_drawn_as_the_target_draws_them(tiny_checkpoints, reference):
    # The target drafting for itself at temperature 1 with top-p and top-k: each draft is drawn
    # under the noise the target will draw that place with, so every draft is the target's own
    # draw and is kept; the seeded request writes what it writes without drafts, the unseeded one
    # is seeded by the engine. A greedy draft would be kept only where the target happens to draw
    # its likeliest token (few times here: the tiny model's distributions are broad).
    target = tiny_checkpoints["llama"]
    llm = tiny_llm(target, speculative_config=draft_config(target, cost_model=False))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=21, max_tokens=40, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    want = reference.generate(PROMPTS[:2], seeded, use_tqdm=False)
    got = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
    assert_same_tokens(want, got)
    llm.generate(PROMPTS[2:4], unseeded, use_tqdm=False)
    stats = llm.engine.stats
    print(f"\n{stats.spec_num_accepted_tokens} of {stats.spec_num_draft_tokens} sampled drafts accepted")
    assert stats.spec_num_draft_tokens >= 100
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_smollm2_drafting_for_itself_follows_a_json_schema(smollm_llm):
    # The embedded GGUF as its own draft: the tokenizers are compared and agree. The draft knows
    # nothing of the grammar; the target's masked draws decide.
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["Give the largest city of France and its population as JSON:",
               "Describe Tokyo as JSON with its population:"]
    llm = LLM(max_model_len=512, dtype="float32", device="cpu",
              speculative_config=draft_config(default_model_path(), cost_model=False))
    want = smollm_llm.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same_tokens(want, got)
    for g in got:
        jsonschema.validate(json.loads(g.outputs[0].text), schema)
    assert llm.engine.stats.spec_num_accepted_tokens > 10


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(tiny_checkpoints, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=512).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 500 token ids and the target 384"):
        tiny_llm(tiny_checkpoints["llama"], speculative_config=draft_config(str(tmp_path / "config.json")))


def test_tokenizers_must_map_every_token_alike():
    def tok(vocab):
        return SimpleNamespace(get_vocab=lambda: vocab)

    same = {"a": 0, "b": 1, "c": 2}
    check_vocabularies(tok(same), tok(dict(same)), 3, 4, "d")  # padded wider: fine
    with pytest.raises(ValueError, match=r"another vocabulary than the target \(2 of 3 tokens differ\)"):
        check_vocabularies(tok(same), tok({"a": 0, "b": 2, "c": 1}), 3, 3, "d")
    with pytest.raises(ValueError, match="1 of 3 tokens differ"):
        check_vocabularies(tok(same), tok({**same, "d": 3}), 3, 4, "d")


@pytest.mark.parametrize("config, extra, message", [
    ({"method": "draft_model"}, {}, "needs a \"model\""),
    ({"method": "ngram", "model": "x"}, {}, "needs a \"model\""),
    ({"method": "draft_model", "model": 3}, {}, "model must be str"),
])
def test_a_bad_draft_model_config_is_a_clear_error(config, extra, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=None, speculative_config=config, **extra)
