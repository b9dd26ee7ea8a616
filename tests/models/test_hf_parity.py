"""Greedy output is token-identical to HF transformers ``generate`` on the same fp32 weights,
through every scheduling path: batched, prefix hits, chunked prefill, one seat, preemption."""

from __future__ import annotations

import random

import pytest
import torch

from deepbatch import LLM, SamplingParams
from hf_reference import hf_greedy_ids

MAX_TOKENS = 12


def make_prompts(n=8, seed=0, vocab=384):
    rng = random.Random(seed)
    lengths = [3, 9, 17, 31, 40, 64, 77, 120][:n]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def shared_prefix_prompts(vocab=384):
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(50)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(k)] for k in (1, 5, 14, 20, 33, 2, 16, 9)]


_HF_CACHE: dict = {}


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = _HF_CACHE.get(path)
    if model is None:
        model = _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy_ids(model, prompts, max_tokens)


def ours(path: str, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_matches_hf(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    prompts = make_prompts()
    got, _ = ours(path, prompts)
    assert got == hf_greedy(path, prompts)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(max_num_batched_tokens=16), id="chunked-prefill-budget-16"),
        pytest.param(dict(max_num_seqs=1), id="one-seat"),
        pytest.param(dict(max_num_seqs=64, block_size=8), id="64-seats-block-8"),
        pytest.param(dict(enable_prefix_caching=False), id="no-prefix-cache"),
    ],
)
def test_scheduling_paths_match_hf(tiny_checkpoints, kwargs):
    path = tiny_checkpoints["llama"]
    prompts = make_prompts()
    got, _ = ours(path, prompts, **kwargs)
    assert got == hf_greedy(path, prompts)


def test_prefix_cache_hits_match_hf(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    prompts = shared_prefix_prompts()
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # First the one prompt alone fills the cache; then the rest hit its 3 full blocks.
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == hf_greedy(path, prompts)
    assert all(o.num_cached_tokens == 48 for o in rest)
    assert llm.engine.kv_cache.num_hit_tokens >= 48 * len(rest)


def test_preemption_matches_hf(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    prompts = make_prompts()
    # 10 blocks of 16 = 160 tokens: enough for the longest request alone, far too few for all.
    got, llm = ours(path, prompts, num_gpu_blocks_override=10, max_num_seqs=8)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_greedy(path, prompts)
    assert llm.engine.kv_cache.pool.num_free_blocks == 10
