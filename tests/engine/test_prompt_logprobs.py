"""``SamplingParams.prompt_logprobs`` end to end, held to HF transformers' log-softmax over the
whole prompt on the same fp32 weights: vLLM's shape (None for the first token, then the prompt
token and the top-k as ``{token_id: Logprob}``), through chunked prefill, prefix caching (a
request that asks takes no hits for positions it still needs, and its blocks still serve
others), n > 1, async scheduling, preemption by recompute and tensor parallelism."""

from __future__ import annotations

import random

import pytest
import torch

from deepbatch import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]


def assert_matches_hf(hf_model, prompt: list[int], got, k: int = K) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for p in range(1, len(prompt)):
        row, token, entry = ref[p - 1], prompt[p], got[p]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4), p
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        vals, ids = row.topk(k)
        top = {t: lp for t, lp in entry.items() if t in ids.tolist()}
        assert set(top) == set(ids.tolist())
        for t, v in zip(ids.tolist(), vals.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert set(entry) == set(ids.tolist()) | {token}


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


MAX_TOKENS = 24  # long enough that 20 blocks of 4 cannot hold every request at once
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=K)


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(), id="whole-prompts"),
    pytest.param(dict(max_num_batched_tokens=8), id="chunked-prefill-budget-8"),
    pytest.param(dict(max_num_batched_tokens=8, async_scheduling=True), id="chunked-async"),
    pytest.param(dict(num_gpu_blocks_override=20, block_size=4, max_num_batched_tokens=16,
                      preemption_mode="recompute"), id="recompute-preemption"),
])
def test_prompt_logprobs_match_hf(tiny_checkpoints, hf_model, kwargs):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=256, **kwargs)
    prompts = make_prompts([1, 2, 7, 19, 33])
    outs = generate(llm, prompts, PARAMS)
    if "preemption_mode" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert outs[0].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf_model, prompt, out.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
    # Asking nothing gives nothing, and the sampled tokens are the same either way.
    plain = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(o.prompt_logprobs is None for o in plain)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]


def test_prefix_cache_shared_prefix(tiny_checkpoints, hf_model):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=256, block_size=4)
    prefix = make_prompts([24], seed=1)[0]
    first, second, third = prefix + [5, 6, 7], prefix + [8, 9], prefix + [10, 11, 12]
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    generate(llm, [first], plain)  # the prefix's blocks are now cached
    (out,) = generate(llm, [second], PARAMS)
    assert out.num_cached_tokens == 0  # a hit has no logits
    assert_matches_hf(hf_model, second, out.prompt_logprobs)
    # Its blocks serve a later request that does not ask.
    hits = llm.engine.kv_cache.num_hit_tokens
    (later,) = generate(llm, [third], plain)
    assert later.num_cached_tokens == 24 and llm.engine.kv_cache.num_hit_tokens - hits == 24


def test_n_samples_share_one_prompt_logprobs(tiny_checkpoints, hf_model):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=256, block_size=4,
              max_num_batched_tokens=8)
    prompt = make_prompts([21], seed=2)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    (out,) = generate(llm, [prompt], params)
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert_matches_hf(hf_model, prompt, out.prompt_logprobs, k=1)


def test_tensor_parallel_prompt_logprobs_match_hf(tiny_checkpoints, hf_model):
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # two ranks share the cores
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=2,
              distributed_timeout_s=30, max_num_batched_tokens=8)
    try:
        # Alone, the long prompt's first chunks sample nothing: steps with prompt logprobs only.
        prompts = make_prompts([19, 5], seed=4)
        (alone,) = generate(llm, prompts[:1], PARAMS)
        assert_matches_hf(hf_model, prompts[0], alone.prompt_logprobs)
        outs = generate(llm, prompts, PARAMS)
        for prompt, out in zip(prompts, outs):
            assert_matches_hf(hf_model, prompt, out.prompt_logprobs)
        assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
        # The ranks stay in step afterwards.
        plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in generate(llm, prompts, plain)] == [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(prev)
    assert not any(p.is_alive() for p in llm.engine.runner._procs)
