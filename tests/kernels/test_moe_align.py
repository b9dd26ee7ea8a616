"""The one-launch MoE pair sort held to its torch reference (``sort_pairs_by_expert``), exactly,
on the CPU through the Triton interpreter (and compiled on a GPU where there is one)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels import moe_align as ma  # noqa: E402
from deepbatch.kernels.moe_align import sort_pairs_by_expert  # noqa: E402


def routed(num_tokens, num_experts, top_k, skew=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    if skew:  # a few hot experts, most never chosen
        scores[:, : max(1, num_experts // 8)] += 1.0
    return scores.topk(top_k, dim=-1).indices.to(DEVICE)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 8, 2, 16), (5, 64, 6, 16), (37, 64, 6, 32), (256, 64, 6, 32),
    (100, 160, 6, 16),   # DeepSeek-V2's 160 experts: not a power of two
    (64, 256, 8, 16),    # V3's 256 experts: narrower chunks
    (3, 64, 6, 128),     # fewer pairs than experts, tall tiles
])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_matches_the_torch_sort_exactly(num_tokens, num_experts, top_k, block_m, skew):
    ids = routed(num_tokens, num_experts, top_k, skew)
    got = ma.moe_align(ids, num_experts, block_m)
    ref = sort_pairs_by_expert(ids, num_experts, block_m)
    for g, r, name in zip(got, ref, ("sorted_ids", "expert_ids", "num_padded")):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        assert torch.equal(g, r), name


def test_int32_ids_and_the_large_batch_fallback(monkeypatch):
    ids = routed(40, 64, 6).to(torch.int32)
    assert all(torch.equal(a, b) for a, b in zip(ma.moe_align(ids, 64, 16), sort_pairs_by_expert(ids, 64, 16)))
    # Past MAX_PAIRS the torch sort runs (same answer): count the kernel's launches.
    monkeypatch.setattr(ma, "MAX_PAIRS", 100)
    calls = []
    real = ma._moe_align_kernel
    monkeypatch.setattr(ma, "_moe_align_kernel", type("K", (), {"__getitem__": lambda s, g: calls.append(g) or real[g]})())
    ma.moe_align(routed(10, 64, 6), 64, 16)  # 60 pairs: the kernel
    ma.moe_align(routed(40, 64, 6), 64, 16)  # 240 pairs: torch
    assert len(calls) == 1


@pytest.mark.parametrize("case", ["rank", "float", "block_m"])
def test_bad_inputs(case):
    ids, block_m = routed(4, 8, 2), 16
    if case == "rank":
        ids = ids.flatten()
    elif case == "float":
        ids = ids.float()
    else:
        block_m = 24
    with pytest.raises(ValueError):
        ma.moe_align(ids, 8, block_m)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_experts,top_k", [(64, 6), (160, 6), (256, 8)])
@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (256, 32), (2048, 128)])
def test_gpu_compiled_matches_exactly(num_experts, top_k, num_tokens, block_m):
    ids = routed(num_tokens, num_experts, top_k, skew=num_tokens == 256, seed=num_tokens)
    got = ma.moe_align(ids, num_experts, block_m)
    ref = sort_pairs_by_expert(ids, num_experts, block_m)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
