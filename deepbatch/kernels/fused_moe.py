"""Routed experts of a mixture-of-experts layer: every token goes through its ``K`` chosen experts'
gated MLPs and the outputs are summed with the router's weights::

    out[t] = sum_k  w[t, k] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, k]

Expert weights are stacked: ``w13 [E, 2I, H]`` (gate rows first, then up) and ``w2 [E, H, I]``.

The Triton path sorts the ``T*K`` (token, expert) pairs by expert and pads each expert's run to a
multiple of ``BLOCK_M``, so every row tile of the grouped GEMM belongs to one expert::

    sorted_ids:  [ e0 pairs | pad ][ e2 pairs ....... | pad ][ e5 | pad ] ...   (pad = T*K)
    expert_ids:  [ 0 ][ 2 ][ 2 ][ 5 ] ...                                        (one per tile)

The sort (``kernels/moe_align.py``, one launch; the torch version here is its reference and the
path for large batches) is sized by host ints only (no device sync), so it can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepbatch.kernels.common import jit as _jit, tl, triton


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float
    topk_ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:
    """Plain PyTorch reference, one expert at a time; sums in float32. Also the CPU backend."""
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = topk_weights.flatten().float()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        h = F.linear(x[tokens], w13[e])  # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e])  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[pairs, None])
    return out.to(x.dtype)



@_jit(do_not_specialize=("num_pairs",))
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """``c[pair] = a[pair // A_ROWS_PER_PAIR_DIV] @ b[expert]^T`` (times the pair's router weight
    with ``MUL_WEIGHT``) for the BLOCK_M pairs of one sorted tile and BLOCK_N output columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid is sized for the worst case padding
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    a_row = (pair // A_ROWS_PER_PAIR_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_valid = offs_k + k < K
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``(sorted_ids, expert_ids, num_padded)`` for the kernel (module docstring). ``sorted_ids``
    lists pair indices ``t*K + k`` grouped by expert, each group padded with ``T*K`` to a multiple
    of ``block_m``; ``expert_ids`` names the expert of each ``block_m`` tile; ``num_padded`` is the
    used length (a one-element tensor). Tiles past it are never read."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount sizes its output from the data (a device sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # The pair's rank inside its expert's run, moved from the unpadded to the padded layout.
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    # Only experts that got a pair are padded: at most min(E, T*K) runs of block_m - 1.
    capacity = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


def _check_inputs(x, w13, w2, topk_weights, topk_ids):
    def fail(msg):
        raise ValueError(f"fused_moe: {msg}")

    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        fail(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, {tuple(w13.shape)}, "
             f"{tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if hidden != x.shape[1] or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        fail(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        fail(f"topk_ids and topk_weights must be [T={x.shape[0]}, K], got {tuple(topk_ids.shape)} and "
             f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_weights.dtype != torch.float32:
        fail(f"topk_ids must be int32/int64 and topk_weights float32, got {topk_ids.dtype} and {topk_weights.dtype}")
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        fail(f"x, w13 and w2 must share one dtype of {_DTYPES}, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            fail(f"{name} is on {t.device}, x on {x.device}")
        if t.stride(-1) != 1:
            fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32/int64
) -> torch.Tensor:
    """Triton version of :func:`fused_moe_ref`: two grouped GEMMs around the gated activation;
    the second scales each pair by its router weight, and the ``K`` pair rows of a token are
    summed at the end (in torch, float32 accumulation)."""
    if triton is None:
        raise RuntimeError("fused_moe: Triton is not installed; use fused_moe_ref")
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    from deepbatch.kernels.moe_align import moe_align
    from deepbatch.kernels.silu_and_mul import silu_and_mul

    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    # Tiles about as tall as an expert's share of the pairs: decode batches leave most of a tall
    # tile empty. On an H200 (DeepSeek-V2-Lite experts, bf16; benchmarks/moe_sweep.py) 128-wide
    # tiles won at both ends: 304 vs 310 us at 256 tokens (block_m 32), 2.11 vs 3.23 ms at 8,192
    # tokens with 128-row tiles instead of 64 x 64.
    block_m = min(128, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, num_experts))))
    block_n = 128 if x.element_size() == 2 else 64  # fp32 tiles that wide crowd shared memory
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, block_m)
    topk_weights = topk_weights.contiguous()
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _launch(x, w13, gate_up, topk_weights, sorted_ids, expert_ids, num_padded, top_k, False, block_m, block_n)
    act = silu_and_mul(gate_up)  # [T*K, I]
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(act, w2, down, topk_weights, sorted_ids, expert_ids, num_padded, 1, True, block_m, block_n)
    return down.view(num_tokens, top_k, hidden).sum(1)


def _launch(a, b, c, topk_weights, sorted_ids, expert_ids, num_padded, a_div, mul_weight, block_m,
            block_n=64, block_k=64, num_warps=4, num_stages=3):
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_padded,
        c.shape[0], n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROWS_PER_PAIR_DIV=a_div, MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
