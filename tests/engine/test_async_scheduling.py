"""Async scheduling (step N+1 scheduled while step N runs) gives exactly the synchronous output.

The CPU runs each step to completion before ``launch`` returns, so what these tests check is the
bookkeeping: pending tokens, the device-side input fix-up, stop checks a step late, preemption
and aborts of requests whose last token is still pending, that only real ids ever reach a hash, a
cached block or an output, and that every request's row in the runner's token pool is released.
"""

from __future__ import annotations

import pytest

from deepbatch import LLM, SamplingParams

PROMPTS = [
    {"prompt_token_ids": [11, 12, 13, 14, 15, 16]},
    {"prompt_token_ids": list(range(40, 77))},
    {"prompt_token_ids": [5, 6]},
    {"prompt_token_ids": list(range(100, 121))},
    {"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18, 19]},  # shares a prefix with the first
]


def run(llm: LLM, async_scheduling: bool, params, prompts=PROMPTS):
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    engine.kv_cache.pool.reset_prefix_cache()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks  # nothing leaked
    assert len(engine.runner.batch) == 0  # every row released
    return [[(o.token_ids, o.finish_reason, o.logprobs) for o in out.outputs] for out in outs]


def cached_tokens(llm: LLM) -> list[int]:
    return [t for b in llm.engine.kv_cache.pool.blocks if b.key is not None for t in b.key[1]]


def real_ids(llm: LLM, ids: list[int]) -> bool:
    return all(0 <= t < llm.engine.hf_config.vocab_size for t in ids)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    # A small budget chunks the longer prompts, so chunked prefill and decodes share steps.
    return LLM(tiny_checkpoints["qwen2"], dtype="float32", device="cpu", max_model_len=256,
               max_num_batched_tokens=16, block_size=8)


def test_greedy_identical_with_stops_and_lengths(llm):
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 7, 30, 12, 20)]
    sync = run(llm, False, greedy)
    # Stop on a token each request is known to produce mid-way, so async stops a step "late"
    # (after the next step was already launched) and must drop that step's token.
    stops = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[o[0][0][len(o[0][0]) // 2]])
             for o in sync]
    stops[0] = SamplingParams(temperature=0.0, max_tokens=1)
    assert run(llm, True, greedy) == sync
    sync_stops = run(llm, False, stops)
    assert [o[0][1] for o in sync_stops][1:] == ["stop"] * 4
    assert run(llm, True, stops) == sync_stops
    assert cached_tokens(llm) and real_ids(llm, cached_tokens(llm))


def test_seeded_sampling_n_and_logprobs_identical(llm):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, n=2, max_tokens=9, logprobs=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    sync = run(llm, False, params)
    assert run(llm, True, params) == sync
    assert all(len(o[2]) == 9 for out in sync for o in out)


def test_penalties_keep_async_scheduling_and_match(llm, monkeypatch):
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=7 + i, max_tokens=14, ignore_eos=True,
                             repetition_penalty=1.5 if i % 2 else 1.2, frequency_penalty=0.5 * (i % 3),
                             presence_penalty=0.3 if i == 1 else 0.0) for i in range(len(PROMPTS))]
    sync = run(llm, False, params)
    sampler = llm.engine.runner.sampler
    real = sampler._apply_penalties
    pending = []

    def spy(logits, requests):
        pending.extend(r.num_pending_tokens for r in requests if r.sampling_params.needs_penalties)
        return real(logits, requests)

    monkeypatch.setattr(sampler, "_apply_penalties", spy)
    assert run(llm, True, params) == sync
    # The penalties were applied while the newest token was still pending (no synchronous step).
    assert pending.count(1) > len(PROMPTS)


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "penalties"])
def test_preemption_with_pending_tokens(tiny_checkpoints, penalty):
    # 10 blocks of 8 tokens cannot hold five requests growing to 60+ tokens: requests are
    # preempted while their newest token is still pending.
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=256, block_size=8,
              num_gpu_blocks_override=10)
    params = [SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, repetition_penalty=penalty,
                             frequency_penalty=penalty - 1.0)] * len(PROMPTS)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"][:32]} for p in PROMPTS]
    sync = run(llm, False, params, prompts)
    llm.engine.scheduler.num_preemptions = 0
    assert run(llm, True, params, prompts) == sync
    assert llm.engine.scheduler.num_preemptions > 0
    assert cached_tokens(llm) and real_ids(llm, cached_tokens(llm))


def test_abort_while_token_pending(llm):
    engine = llm.engine
    engine.async_scheduling = True
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for _ in range(4):
        engine.step()
    a = engine.scheduler.requests["a"]
    assert a.num_pending_tokens == 1
    num_committed = a.num_output_tokens - 1
    aborted = engine.abort_request("a")
    assert aborted.finished and len(aborted.outputs[0].token_ids) == num_committed
    assert real_ids(llm, aborted.outputs[0].token_ids)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert len(done["b"].outputs[0].token_ids) == 5
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks


def test_chat_with_stop_string(smollm_llm):
    engine = smollm_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["Paris"], include_stop_str_in_output=True)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        engine.async_scheduling = False
        sync = smollm_llm.chat(question, params, use_tqdm=False)[0]
        engine.async_scheduling = True
        asynced = smollm_llm.chat(question, params, use_tqdm=False)[0]
    finally:
        engine.async_scheduling = False
    assert sync.outputs[0].text.endswith("Paris") and sync.outputs[0].finish_reason == "stop"
    assert asynced.outputs[0].text == sync.outputs[0].text
    assert asynced.outputs[0].token_ids == sync.outputs[0].token_ids
