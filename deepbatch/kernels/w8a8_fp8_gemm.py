"""W8A8 FP8 GEMMs: ``out [M, N] = x [M, K] @ w [N, K]^T`` with both operands in ``float8_e4m3fn``
and float32 dequantization scales (``x ~ x_q * x_s``, ``w ~ w_q * w_s``; see
``kernels/fp8_quant.py`` for the formats). Products of e4m3 values are exact in float32; every
sum of more than one K step (128 columns) is kept in float32 and only the result is cast to
``out_dtype``.

* Block-wise (DeepSeek-V3/R1): ``x_s [M, ceil(K/bk)]`` per token and group of ``bk`` columns,
  ``w_s [ceil(N/bn), ceil(K/bk)]`` per ``bn x bk`` weight block (the checkpoint's
  ``weight_scale_inv``, a multiplier). The scales change along K, so each ``bk``-long stretch of
  the dot product is scaled as it is added::

      out[m, n] = sum_kb  (x_q[m, kb] . w_q[n, kb]) * x_s[m, kb] * w_s[n // bn, kb]

* Per-channel (FP8_DYNAMIC, online FP8): ``x_s [M, 1]`` per token, ``w_s [N]`` per output row,
  applied once after the whole dot product (a single ``[1]`` scale on either side is taken as
  per-tensor)::

      out[m, n] = (x_q[m] . w_q[n]) * x_s[m] * w_s[n]  (+ bias[n])

The block-wise GEMM can also run in cuBLASLt (``backend="cublas"``: ``torch._scaled_mm`` with
DeepSeek-style scaling, SM90 only), whose scale layouts are fixed (it takes no leading dimension
for them; see :func:`cublas_block_operands`).

On a GPU the fp8 tiles go to ``tl.dot`` as they are (Hopper and Ada tensor cores). Off CUDA the
kernels run in the Triton interpreter, where ``UPCAST_DOT`` widens the tiles to float32 before the
dot: whether the interpreter's ``tl.dot`` takes fp8 operands depends on the Triton version, and
e4m3 values are exact in float32, so the CPU tests check the addressing, the masks and where each
scale is applied on any version; the native dot is checked by the GPU tests against the same
references.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton
from deepbatch.kernels.fp8_quant import FP8_DTYPE, check_block_size, require_native_fp8
from deepbatch.kernels.fp8_scaled_mm import (cublas_block_fp8_matmul, cublas_block_unsupported, cublas_channel_applies,
                                             cublas_channel_fp8_matmul)

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- torch ------------------------------------------------------------------------------------


def _check_operands(name, x_q, x_s, w_q, w_s, out_dtype, scale_shapes, bias=None):
    """Shapes, dtypes and devices of a W8A8 call; ``scale_shapes(M, N, K)`` gives the accepted
    shapes of ``x_s`` and of ``w_s``."""
    def fail(msg):
        raise ValueError(f"{name}: {msg}")

    for what, t in (("x_q", x_q), ("w_q", w_q)):
        if not torch.is_tensor(t) or t.dim() != 2 or t.dtype != FP8_DTYPE:
            got = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
            fail(f"{what} must be a 2-D {FP8_DTYPE} tensor, got {got}")
    if x_q.shape[1] != w_q.shape[1]:
        fail(f"x_q {tuple(x_q.shape)} and w_q {tuple(w_q.shape)} disagree on K")
    x_s_shapes, w_s_shapes = scale_shapes(x_q.shape[0], w_q.shape[0], x_q.shape[1])
    for what, t, shapes in (("x_s", x_s, x_s_shapes), ("w_s", w_s, w_s_shapes)):
        if not torch.is_tensor(t) or t.dtype != torch.float32 or tuple(t.shape) not in shapes:
            got = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
            fail(f"{what} must be float32 of shape {' or '.join(map(str, dict.fromkeys(shapes)))}, got {got}")
    if out_dtype not in _OUT_DTYPES:
        fail(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if bias is not None and (not torch.is_tensor(bias) or tuple(bias.shape) != (w_q.shape[0],)
                             or bias.dtype not in _OUT_DTYPES):
        got = f"{bias.dtype} {tuple(bias.shape)}" if torch.is_tensor(bias) else type(bias).__name__
        fail(f"bias must be a float tensor of shape ({w_q.shape[0]},), got {got}")
    for what, t in (("x_s", x_s), ("w_q", w_q), ("w_s", w_s), ("bias", bias)):
        if t is not None and t.device != x_q.device:
            fail(f"{what} is on {t.device}, x_q on {x_q.device}")


def _check_block_operands(name, x_q, x_s, w_q, w_s, block_size, out_dtype) -> tuple[int, int]:
    bn, bk = check_block_size(block_size, name)

    def scale_shapes(m, n, k):
        return [(m, -(-k // bk))], [(-(-n // bn), -(-k // bk))]

    _check_operands(name, x_q, x_s, w_q, w_s, out_dtype, scale_shapes)
    return bn, bk


def w8a8_block_fp8_matmul_ref(
    x_q: torch.Tensor,  # [M, K] e4m3
    x_s: torch.Tensor,  # [M, ceil(K/bk)] float32
    w_q: torch.Tensor,  # [N, K] e4m3
    w_s: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block_size: tuple[int, int],  # (bn, bk)
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: one float32 partial product per ``bk``-long stretch of K,
    scaled by that stretch's activation and weight scales, summed in float32."""
    bn, bk = _check_block_operands("w8a8_block_fp8_matmul_ref", x_q, x_s, w_q, w_s, block_size, out_dtype)
    n, k = w_q.shape
    w_s_rows = w_s.repeat_interleave(bn, 0)[:n]  # [N, k_blocks]: each output row's own scales
    out = torch.zeros(x_q.shape[0], n, dtype=torch.float32, device=x_q.device)
    for kb, start in enumerate(range(0, k, bk)):
        cols = slice(start, min(start + bk, k))
        partial = x_q[:, cols].float() @ w_q[:, cols].float().T
        out += partial * x_s[:, kb : kb + 1] * w_s_rows[:, kb]
    return out.to(out_dtype)


def _channel_scale_shapes(m, n, k):
    return [(m, 1), (1, 1), (1,)], [(n, 1), (n,), (1, 1), (1,)]


def w8a8_channel_fp8_matmul_ref(
    x_q: torch.Tensor,  # [M, K] e4m3
    x_s: torch.Tensor,  # [M, 1] float32 (or [1] per-tensor)
    w_q: torch.Tensor,  # [N, K] e4m3
    w_s: torch.Tensor,  # [N, 1] or [N] float32 (or [1] per-tensor)
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``(x_q @ w_q^T) * x_s * w_s^T (+ bias)`` in float32, cast to ``out_dtype``."""
    _check_operands("w8a8_channel_fp8_matmul_ref", x_q, x_s, w_q, w_s, out_dtype,
                    _channel_scale_shapes, bias=bias)
    out = (x_q.float() @ w_q.float().T) * x_s.reshape(-1, 1) * w_s.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# -- Triton -----------------------------------------------------------------------------------


@_jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The output tile of this program. Consecutive programs walk down ``GROUP_M`` row tiles
    before moving right, so a band of weight columns is read from L2 by several row tiles."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@_jit(do_not_specialize=("M",))
def _w8a8_block_fp8_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr,
    M, N, K, group_n, group_k,
    stride_am, stride_bn, stride_cm, stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile; ``BLOCK_K`` divides ``group_k``, so every K step
    lies in one scale group. Weight scales are looked up per output column (``n // group_n``),
    so ``group_n`` need not be a multiple of ``BLOCK_N``."""
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * stride_as_m
    bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k
        a = tl.load(a_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        kb = k // group_k
        a_s = tl.load(as_ptrs + kb * stride_as_k, mask=m_valid, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bs_k, mask=n_valid, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@_jit(do_not_specialize=("M",))
def _w8a8_channel_fp8_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_as, stride_bs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile; the scales (stride 0 for a per-tensor one) and
    the bias are applied to the float32 accumulator once, after the K loop."""
    offs_m, offs_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k
        a = tl.load(a_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # Hopper's fp8 MMA keeps fewer bits than float32 in its accumulator and Triton lets it
        # run over the whole K unless told: add it into the float32 sum every K step, as the
        # block kernel does.
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_s = tl.load(as_ptr + offs_m * stride_as, mask=m_valid, other=0.0)
    b_s = tl.load(bs_ptr + offs_n * stride_bs, mask=n_valid, other=0.0)
    acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


# Launch settings by batch size (rows of x), from a sweep on an H200 (bf16 out; N x K = 4096 x 7168,
# 7168 x 2048, 18432 x 7168; M = 1 to 4096). Few rows (decode) read every weight byte for a handful
# of tokens: the GEMM is bound by weight bandwidth and by launch overhead; the tile width barely
# mattered (32 to 128 columns within noise at 18432 x 7168). Many rows are bound by the tensor
# cores. The block kernel scales every K step's dot product before adding it, so each step waits
# for its dot: 64 x 128 tiles beat 128 x 128 at every M from 256 on (409 vs 440 us at 4096 x 4096 x 7168;
# 4 warps on 128 x 128 took 1,023 us; bf16 cuBLAS 325 us). The per-channel kernel took wide tiles
# best from a few hundred rows on.
_BLOCK_CONFIGS = (
    # max M, BLOCK_M, BLOCK_N, num_warps, num_stages
    (16, 16, 64, 4, 4),  # decode: M is padded to the smallest tile tl.dot takes
    (None, 64, 128, 4, 4),  # everything larger
)
_CHANNEL_CONFIGS = (
    (16, 16, 64, 4, 4),  # decode
    (256, 64, 128, 4, 4),  # small batches
    (None, 128, 256, 8, 3),  # prefill
)
_GROUP_M = 8


def _config(table, m: int):
    for max_m, *cfg in table:
        if max_m is None or m <= max_m:
            return cfg
    raise AssertionError("the last config takes every M")


def _upcast_dot(device: torch.device) -> bool:
    return device.type != "cuda"


def _check_last_dim(name, tensors):
    for what, t in tensors:
        if t is not None and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name}: {what} needs a contiguous last dimension, strides {t.stride()}")


def w8a8_block_fp8_matmul(
    x_q: torch.Tensor,  # [M, K] e4m3
    x_s: torch.Tensor,  # [M, ceil(K/bk)] float32
    w_q: torch.Tensor,  # [N, K] e4m3
    w_s: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block_size: tuple[int, int],  # (bn, bk); bk is the activation group size
    out_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`w8a8_block_fp8_matmul_ref` on the GPU. ``backend="triton"`` runs the Triton kernel:
    ``bk`` must be a multiple of 32 (the K of one fp8 tensor-core instruction), ``bn`` may be
    anything. ``"cublas"`` runs cuBLASLt's DeepSeek-style GEMM and raises ValueError saying why
    where it does not apply (128 x 128 blocks, N and K multiples of 128, bf16 out, CUDA on SM90, a
    torch that has it). ``"auto"`` runs what ``BLOCK_AUTO_BACKEND`` names (cuBLASLt only where it
    applies)."""
    name = "w8a8_block_fp8_matmul"
    if backend not in ("auto", "triton", "cublas"):
        raise ValueError(f"{name}: backend must be 'auto', 'triton' or 'cublas', got {backend!r}")
    bn, bk = _check_block_operands(name, x_q, x_s, w_q, w_s, block_size, out_dtype)
    if bk % 32:
        raise ValueError(f"{name}: block size bk={bk} must be a multiple of 32")
    _check_last_dim(name, (("x_q", x_q), ("w_q", w_q)))
    if backend == "cublas" or (backend == "auto" and BLOCK_AUTO_BACKEND == "cublas"):
        reason = cublas_block_unsupported(x_q, w_q, (bn, bk), out_dtype)
        if reason is None:
            return cublas_block_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype)
        if backend == "cublas":
            raise ValueError(f"{name}: backend 'cublas' {reason}; backend 'triton' takes this call")
    require_native_fp8(name, x_q.device)
    (m, k), n = x_q.shape, w_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, num_warps, num_stages = _config(_BLOCK_CONFIGS, m)
    block_k = min(128, bk & -bk)  # the largest power of two dividing bk: one scale per K step
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_fp8_kernel[grid](
        x_q, w_q, out, x_s, w_s, m, n, k, bn, bk,
        x_q.stride(0), w_q.stride(0), out.stride(0), x_s.stride(0), x_s.stride(1), w_s.stride(0), w_s.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M,
        UPCAST_DOT=_upcast_dot(x_q.device), num_warps=num_warps, num_stages=num_stages,
    )
    return out


# What ``backend="auto"`` runs for the block-wise GEMM: "triton", or "cublas" for cuBLASLt where it
# applies (the Triton kernel elsewhere). The cuBLASLt path has not run on a GPU yet; switch once
# ``tests/kernels/test_w8a8_fp8_gemm.py -m gpu`` passes on an H200 and the sweep's
# ``fp8-block-cublas`` column beats ``fp8-block-triton``.
BLOCK_AUTO_BACKEND = "triton"
def w8a8_channel_fp8_matmul(
    x_q: torch.Tensor,  # [M, K] e4m3
    x_s: torch.Tensor,  # [M, 1] float32 (or [1] per-tensor)
    w_q: torch.Tensor,  # [N, K] e4m3
    w_s: torch.Tensor,  # [N, 1] or [N] float32 (or [1] per-tensor)
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`w8a8_channel_fp8_matmul_ref` on the GPU. ``backend="auto"`` takes cuBLASLt's
    row-wise-scaled FP8 GEMM (``torch._scaled_mm``) where it applies and the Triton kernel
    elsewhere; ``"triton"`` forces the kernel. The library GEMM is the default because the Triton
    kernel, with one tile table for every shape, ran Llama-3.1-8B's online-FP8 linears slower than
    cuBLAS ran them in bf16 (``random-1k`` on an H200: 0.86x the bf16 run; docs/benchmarks.md)."""
    name = "w8a8_channel_fp8_matmul"
    if backend not in ("auto", "triton"):
        raise ValueError(f"{name}: backend must be 'auto' or 'triton', got {backend!r}")
    _check_operands(name, x_q, x_s, w_q, w_s, out_dtype, _channel_scale_shapes, bias=bias)
    _check_last_dim(name, (("x_q", x_q), ("w_q", w_q), ("bias", bias)))
    require_native_fp8(name, x_q.device)
    (m, k), n = x_q.shape, w_q.shape[0]
    if backend == "auto" and cublas_channel_applies(x_q, x_s, w_q, w_s, out_dtype):
        out = cublas_channel_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype)
        return out if bias is None else out.add_(bias)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, num_warps, num_stages = _config(_CHANNEL_CONFIGS, m)
    # A single scale is read by every row (column) through stride 0.
    stride_as = x_s.stride(0) if x_s.shape[0] == m and m > 1 else 0
    stride_bs = w_s.stride(0) if w_s.shape[0] == n and n > 1 else 0
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_channel_fp8_kernel[grid](
        x_q, w_q, out, x_s, w_s, bias if bias is not None else w_s,
        m, n, k, x_q.stride(0), w_q.stride(0), out.stride(0), stride_as, stride_bs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=_GROUP_M,
        UPCAST_DOT=_upcast_dot(x_q.device), HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
