"""Routed experts of a mixture-of-experts layer: every token goes through its ``K`` chosen experts'
gated MLPs and the outputs are summed with the router's weights::

    out[t] = sum_k  w[t, k] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, k]

Expert weights are stacked: ``w13 [E, 2I, H]`` (gate rows first, then up) and ``w2 [E, H, I]``.

The Triton path sorts the ``T*K`` (token, expert) pairs by expert and pads each expert's run to a
multiple of ``BLOCK_M``, so every row tile of the grouped GEMM belongs to one expert::

    sorted_ids:  [ e0 pairs | pad ][ e2 pairs ....... | pad ][ e5 | pad ] ...   (pad = T*K)
    expert_ids:  [ 0 ][ 2 ][ 2 ][ 5 ] ...                                        (one per tile)

The sort (``kernels/moe_align.py``, one launch; its torch reference ``sort_pairs_by_expert`` is the
path for large batches) is sized by host ints only (no device sync), so it can be captured in a
CUDA graph.

FP8 block-wise experts (DeepSeek-V3/R1): ``w13`` and ``w2`` in ``float8_e4m3fn`` with one float32
multiplier per ``bn x bk`` block (``weight_scale_inv``: ``W = w_q * scale``; stacked per expert as
``[E, ceil(rows/bn), ceil(cols/bk)]``), and each GEMM input quantized at run time per token and
``bk``-column group (``kernels/fp8_quant.py``). Both scales change along K, so the grouped GEMM
scales each ``bk``-long stretch of the dot product as it is added, in float32::

    out[p, n] = sum_kb  (a_q[p, kb] . w_q[e, n, kb]) * a_s[p, kb] * w_s[e, n // bn, kb]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepbatch.kernels.common import jit as _jit
from deepbatch.kernels.common import tl, triton
from deepbatch.kernels.fp8_quant import (
    FP8_DTYPE,
    check_block_size,
    native_fp8_supported,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
)
from deepbatch.kernels.moe_align import moe_align
from deepbatch.kernels.w8a8_fp8_gemm import w8a8_block_fp8_matmul_ref


def _sum_over_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_mlp) -> torch.Tensor:
    """``sum_k w[t, k] * expert_mlp(e, tokens)[t]`` in float32, cast to ``x``'s dtype: the (token,
    expert) pairs grouped by expert, each expert run once on its tokens (``expert_mlp(e, tokens)``
    returns those tokens' outputs ``[n, H]``)."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = topk_weights.flatten().float()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        out.index_add_(0, tokens, expert_mlp(e, tokens).float() * flat_weights[pairs, None])
    return out.to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float
    topk_ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:
    """Plain PyTorch reference, one expert at a time; sums in float32. Also the CPU backend."""
    inter = w2.shape[2]

    def expert_mlp(e, tokens):
        h = F.linear(x[tokens], w13[e])  # [n, 2I]
        return F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e])  # [n, H]

    return _sum_over_experts(x, topk_weights, topk_ids, w13.shape[0], expert_mlp)


def fused_moe_fp8_block_ref(
    x: torch.Tensor,  # [T, H] fp16/bf16/fp32
    w13: torch.Tensor,  # [E, 2I, H] float8_e4m3fn
    w2: torch.Tensor,  # [E, H, I] float8_e4m3fn
    w13_scale: torch.Tensor,  # [E, ceil(2I/bn), ceil(H/bk)] float32
    w2_scale: torch.Tensor,  # [E, ceil(H/bn), ceil(I/bk)] float32
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32/int64
    block_size: tuple[int, int] = (128, 128),  # (bn, bk)
) -> torch.Tensor:
    """:func:`fused_moe_ref` with both GEMMs in W8A8 FP8 block-wise form (module docstring).

    Each GEMM input (``x``, then the activated intermediate) is quantized per token and ``bk``
    columns with :func:`per_token_group_quant_fp8_ref`; each ``bk`` stretch's partial product is
    scaled by its token-group and weight-block scales and summed in float32. The gate/up result is
    cast to ``x``'s dtype before ``silu(gate) * up``, which runs in that dtype as in
    :func:`fused_moe_ref` (the Triton path stores it so between its kernels); the down products
    are weighted and summed over a token's experts in float32 and cast to ``x``'s dtype once.
    ``I`` must be a multiple of ``bn``, so no scale block of ``w13`` mixes gate and up rows."""
    bn, bk = _check_inputs(x, w13, w2, topk_weights, topk_ids, "fused_moe_fp8_block_ref",
                           (w13_scale, w2_scale, block_size))
    inter = w2.shape[2]
    x_q, x_s = per_token_group_quant_fp8_ref(x, bk)  # per token: one quantization serves all K pairs

    def expert_mlp(e, tokens):
        h = w8a8_block_fp8_matmul_ref(x_q[tokens], x_s[tokens], w13[e], w13_scale[e], (bn, bk), x.dtype)
        h_q, h_s = per_token_group_quant_fp8_ref(F.silu(h[:, :inter]) * h[:, inter:], bk)
        return w8a8_block_fp8_matmul_ref(h_q, h_s, w2[e], w2_scale[e], (bn, bk), torch.float32)

    return _sum_over_experts(x, topk_weights, topk_ids, w13.shape[0], expert_mlp)



@_jit(do_not_specialize=("num_pairs",))
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, as_ptr, bs_ptr,
    num_pairs, N, K, group_n, group_k,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_as_m, stride_as_k, stride_bs_e, stride_bs_n, stride_bs_k,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_SCALED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """``c[pair] = a[pair // A_ROWS_PER_PAIR_DIV] @ b[expert]^T`` (times the pair's router weight
    with ``MUL_WEIGHT``) for the BLOCK_M pairs of one sorted tile and BLOCK_N output columns.

    ``BLOCK_SCALED``: ``a`` and ``b`` are e4m3 with scales ``as [rows of a, ceil(K/group_k)]`` and
    ``bs [E, ceil(N/group_n), ceil(K/group_k)]``; ``BLOCK_K`` divides ``group_k``, so each K step
    lies in one scale group, and the weight scale is looked up per output column (``n // group_n``),
    so ``group_n`` need not match ``BLOCK_N``. ``UPCAST_DOT`` widens the fp8 tiles to float32 before
    the dot (exact for e4m3): the interpreter's ``tl.dot`` is not faithful on fp8 operands."""
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
    as_ptrs = as_ptr + a_row * stride_as_m
    bs_ptrs = bs_ptr + expert * stride_bs_e + (offs_n // group_n) * stride_bs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_valid = offs_k + k < K
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if BLOCK_SCALED:
            kb = k // group_k
            a_s = tl.load(as_ptrs + kb * stride_as_k, mask=row_valid, other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_bs_k, mask=n_valid, other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(x, w13, w2, topk_weights, topk_ids, name="fused_moe", fp8_block=None):
    """Raises ValueError on a bad call; with ``fp8_block = (w13_scale, w2_scale, block_size)``
    checks the FP8 block-wise form and returns ``(bn, bk)``."""
    def fail(msg):
        raise ValueError(f"{name}: {msg}")

    tensors = (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids))
    for what, t in tensors:
        if not torch.is_tensor(t):
            fail(f"{what} must be a tensor, got {type(t).__name__}")
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
    if fp8_block is None:
        if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
            hint = " (fp8 experts need w13_scale, w2_scale and block_size)" if FP8_DTYPE in (w13.dtype, w2.dtype) else ""
            fail(f"x, w13 and w2 must share one dtype of {_DTYPES}, got {x.dtype}, {w13.dtype}, {w2.dtype}{hint}")
    else:
        block = _check_block_scales(fail, name, x, w13, w2, *fp8_block)
        tensors += (("w13_scale", fp8_block[0]), ("w2_scale", fp8_block[1]))
    for what, t in tensors:
        if t.device != x.device:
            fail(f"{what} is on {t.device}, x on {x.device}")
        if what in ("x", "w13", "w2", "topk_weights", "topk_ids") and t.stride(-1) != 1:
            fail(f"{what} needs a contiguous last dimension, strides {t.stride()}")
    return None if fp8_block is None else block


def _check_block_scales(fail, name, x, w13, w2, w13_scale, w2_scale, block_size):
    bn, bk = check_block_size(block_size, name)
    if x.dtype not in _DTYPES or w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        fail(f"x must be one of {_DTYPES} and w13, w2 {FP8_DTYPE}; got {x.dtype}, {w13.dtype}, {w2.dtype}")
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if inter % bn:
        fail(f"intermediate size I={inter} must be a multiple of bn={bn}: a scale block of w13 would mix "
             f"gate and up rows")
    for what, s, rows, cols in (("w13_scale", w13_scale, two_i, hidden), ("w2_scale", w2_scale, hidden, inter)):
        want = (num_experts, -(-rows // bn), -(-cols // bk))
        if not torch.is_tensor(s) or s.dtype != torch.float32 or tuple(s.shape) != want:
            got = f"{s.dtype} {tuple(s.shape)}" if torch.is_tensor(s) else type(s).__name__
            fail(f"{what} must be float32 of shape {want} for block {(bn, bk)}, got {got}")
    return bn, bk


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32/int64
    w13_scale: torch.Tensor | None = None,  # [E, ceil(2I/bn), ceil(H/bk)] float32
    w2_scale: torch.Tensor | None = None,  # [E, ceil(H/bn), ceil(I/bk)] float32
    block_size: tuple[int, int] | None = None,  # (bn, bk)
) -> torch.Tensor:
    """Triton version of :func:`fused_moe_ref`: two grouped GEMMs around the gated activation;
    the second scales each pair by its router weight, and the ``K`` pair rows of a token are
    summed at the end (in torch, float32 accumulation).

    With ``w13_scale``, ``w2_scale`` and ``block_size`` the experts are FP8 block-wise (e4m3
    ``w13``/``w2``): the Triton version of :func:`fused_moe_fp8_block_ref`. Each GEMM input is
    quantized per token and ``bk`` columns by ``per_token_group_quant_fp8`` first; ``bk`` must be a
    multiple of 16 (the shortest K a ``tl.dot`` takes) and ``I`` a multiple of ``bn``."""
    if triton is None:
        raise RuntimeError("fused_moe: Triton is not installed; use fused_moe_ref")
    scales = (w13_scale, w2_scale, block_size)
    fp8_block = None
    if any(v is not None for v in scales):
        if any(v is None for v in scales):
            raise ValueError("fused_moe: fp8 block-wise experts need all of w13_scale, w2_scale and block_size")
        fp8_block = scales
    block = _check_inputs(x, w13, w2, topk_weights, topk_ids, fp8_block=fp8_block)
    if block is not None:
        if block[1] % 16:
            raise ValueError(f"fused_moe: block size bk={block[1]} must be a multiple of 16")
        if not native_fp8_supported(x.device):
            cap = torch.cuda.get_device_capability(x.device)
            raise RuntimeError(f"fused_moe: float8_e4m3fn needs a GPU of compute capability 8.9 or newer, "
                               f"{x.device} is {cap[0]}.{cap[1]}; use fused_moe_fp8_block_ref")
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
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, block_m)
    topk_weights = topk_weights.contiguous()
    route = (topk_weights, sorted_ids, expert_ids, num_padded)
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if block is None:
        block_n = 128 if x.element_size() == 2 else 64  # fp32 tiles that wide crowd shared memory
        _launch(x, w13, gate_up, *route, top_k, False, block_m, block_n)
        _launch(silu_and_mul(gate_up), w2, down, *route, 1, True, block_m, block_n)
    else:
        bk = block[1]
        fp8 = {"block": block, "block_n": 128, "block_k": min(128, bk & -bk)}  # one scale group per K step
        x_q, x_s = per_token_group_quant_fp8(x, bk)  # per token: one quantization serves all K pairs
        _launch(x_q, w13, gate_up, *route, top_k, False, block_m, a_s=x_s, b_s=w13_scale, **fp8)
        act_q, act_s = per_token_group_quant_fp8(silu_and_mul(gate_up), bk)
        _launch(act_q, w2, down, *route, 1, True, block_m, a_s=act_s, b_s=w2_scale, **fp8)
    return down.view(num_tokens, top_k, hidden).sum(1)


def _launch(a, b, c, topk_weights, sorted_ids, expert_ids, num_padded, a_div, mul_weight, block_m,
            block_n=64, block_k=64, num_warps=4, num_stages=3, a_s=None, b_s=None, block=None):
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    if block is None:  # the scale arguments are never read
        a_s = b_s = c
        group_n = group_k = 1
        scale_strides = (0,) * 5
    else:
        group_n, group_k = block
        scale_strides = (a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1), b_s.stride(2))
    _grouped_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_padded, a_s, b_s,
        c.shape[0], n, k, group_n, group_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        *scale_strides,
        A_ROWS_PER_PAIR_DIV=a_div, MUL_WEIGHT=mul_weight, BLOCK_SCALED=block is not None,
        UPCAST_DOT=block is not None and a.device.type != "cuda",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
