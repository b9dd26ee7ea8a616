"""JSON-schema outputs of the embedded SmolLM2 validate with ``jsonschema``: greedy and sampled,
n=2, async scheduling on and off, and through chunked prefill and preemption (recompute and swap)
on a tiny token budget and KV cache."""

from __future__ import annotations

import re

import pytest
from sotest_helpers import chat, check_json_outputs, json_params
from sotest_schemas import SCHEMAS

from deepbatch import LLM, SamplingParams

NAMES = list(SCHEMAS)
SCHEMA_LIST = [SCHEMAS[n] for n in NAMES]
MAX_TOKENS = 256


def prompts(llm):
    return [chat(llm, f"Reply with a JSON value ({n.replace('_', ' ')}).") for n in NAMES]


def generate(llm, params, prompt_list, async_scheduling):
    llm.engine.async_scheduling = async_scheduling
    outs = llm.generate(prompt_list, params, use_tqdm=False)
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.num_blocks
    return outs


def token_ids(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_greedy_async_matches_sync(llm):
    # Half the schemas allow any whitespace (the default), half none.
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             structured_outputs=json_params(s, disable_any_whitespace=i % 2 == 1))
              for i, s in enumerate(SCHEMA_LIST)]
    ps = prompts(llm)
    sync = generate(llm, params, ps, async_scheduling=False)
    # A small model may spend its budget on blank lines where any whitespace is allowed.
    assert check_json_outputs(sync, SCHEMA_LIST, MAX_TOKENS) >= len(NAMES) - 1
    # Without any whitespace only the single spaces of ", " and ": " separate tokens.
    outside_strings = [re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text) for o in sync[1::2] for c in o.outputs]
    assert not any(ws in text for text in outside_strings for ws in ("\n", "\t", "  "))
    asynced = generate(llm, params, ps, async_scheduling=True)
    assert token_ids(asynced) == token_ids(sync)


def sampled_params(n=2):
    return [SamplingParams(temperature=1.0, seed=1000 + i, n=n, max_tokens=MAX_TOKENS, logprobs=1,
                           structured_outputs=json_params(s, disable_any_whitespace=True))
            for i, s in enumerate(SCHEMA_LIST)]


def test_sampled_n2_async_on_and_off(llm):
    ps = prompts(llm)
    sync = generate(llm, sampled_params(), ps, async_scheduling=False)
    assert check_json_outputs(sync, SCHEMA_LIST, MAX_TOKENS) >= 2 * len(NAMES) - 2
    texts = [[c.text for c in o.outputs] for o in sync]
    assert sum(a != b for a, b in texts) >= len(NAMES) // 2  # the two samples really differ
    # Seeded samples are a function of the seed alone, so async scheduling gives the same tokens.
    asynced = generate(llm, sampled_params(), ps, async_scheduling=True)
    assert token_ids(asynced) == token_ids(sync)
    # A constrained row's logprobs are those of the masked distribution it was sampled from.
    for o in asynced:
        for c in o.outputs:
            assert all(e[t].logprob > float("-inf") for t, e in zip(c.token_ids, c.logprobs))


@pytest.fixture(scope="module")
def tiny_budget_llm():
    # 16 tokens a step chunks every prompt; 24 blocks of 16 tokens hold about six of the 24
    # sequences at once, so requests are preempted (by swap or recompute, per test) mid-output.
    return LLM(max_model_len=1024, dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=16,
               num_gpu_blocks_override=24, swap_space=0.05, enable_prefix_caching=False)


def short_prompts(llm):
    return [{"prompt_token_ids": llm.engine.tokenize(f"Here is a JSON value for the schema named {n}, "
                                                     "as compact as possible:")} for n in NAMES]


@pytest.mark.parametrize("mode, async_scheduling", [("recompute", True), ("swap", False)])
def test_chunked_prefill_and_preemption(tiny_budget_llm, mode, async_scheduling):
    llm = tiny_budget_llm
    engine = llm.engine
    engine.scheduler.preemptor.mode = mode
    before = dict(engine.scheduler.preemptor.num_preemptions_by_mode)
    ps = short_prompts(llm)
    assert min(len(p["prompt_token_ids"]) for p in ps) > engine.scheduler.max_num_batched_tokens
    params = sampled_params()
    outs = generate(llm, params, ps, async_scheduling)
    assert engine.scheduler.preemptor.num_preemptions_by_mode[mode] > before[mode]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert check_json_outputs(outs, SCHEMA_LIST, MAX_TOKENS) >= 2 * len(NAMES) - 2
