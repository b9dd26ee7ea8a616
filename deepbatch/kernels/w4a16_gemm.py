"""Weight-only 4-bit linear layers (W4A16): ``y = x @ W^T`` with ``W`` stored as unsigned 4-bit
integers plus a scale and a zero point per group of ``group_size`` input channels.

Every 4-bit checkpoint format (AWQ, GPTQ, compressed-tensors pack-quantized) is converted at load
into this one layout, the only one the kernel reads::

    qweight  int32 [K // 8, N]      q(n, k) = (qweight[k // 8, n] >> (4 * (k % 8))) & 0xF
                                    (packed along K, lowest nibble first; K a multiple of 8)
    scales   [K // group_size, N]   activation dtype (fp16 / bf16 / fp32)
    zeros    [K // group_size, N]   activation dtype; the zero point as a number (8.0 when symmetric)

    W[n, k] = (q(n, k) - zeros[k // group_size, n]) * scales[k // group_size, n]

``group_size`` is a multiple of 8 that divides ``K``; ``group_size == K`` is one group per output
channel. ``x`` is ``[M, K]`` and ``y`` ``[M, N]``, both in the activation dtype.

The Triton kernel dequantizes one ``[BLOCK_K, BLOCK_N]`` weight tile at a time from a
``[BLOCK_K // 8, BLOCK_N]`` int32 tile and feeds it to ``tl.dot`` (fp32 accumulation), so the
weights cross HBM once, at 4 bits. Decode-sized batches (few output tiles) split K over extra
programs; each writes an fp32 partial sum and a second kernel adds the partials in a fixed order
(deterministic, unlike atomic adds), adds the bias and casts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepbatch.kernels.common import jit as _jit
from deepbatch.kernels.common import max_shared_memory, num_sms, tl, triton

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NIBBLE_SHIFTS = tuple(4 * i for i in range(8))


def _fail(fn: str, msg: str):
    raise ValueError(f"{fn}: {msg}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` integers in ``0..15`` -> int32 ``[K // 8, N]`` (module docstring's layout)."""
    if q.dim() != 2 or q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
        _fail("pack_int4", f"q must be a 2-D integer tensor [K, N], got {q.dtype} {tuple(q.shape)}")
    k, n = q.shape
    if k % 8:
        _fail("pack_int4", f"K={k} must be a multiple of 8 (eight nibbles per int32)")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        _fail("pack_int4", f"values must lie in 0..15, got {int(q.min())}..{int(q.max())}")
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int64, device=q.device)
    # int64, so that the top nibble's bit 31 does not overflow; then wrapped into int32's range.
    packed = (q.to(torch.int64).view(k // 8, 8, n) << shifts[None, :, None]).sum(1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 ``[K // 8, N]`` -> int32 ``[K, N]`` of values ``0..15``; the inverse of :func:`pack_int4`."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        _fail("unpack_int4", f"qweight must be int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    rows, n = qweight.shape
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=qweight.device)
    # The arithmetic shift smears the sign bit into the top nibble; the mask removes it.
    return ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(rows * 8, n)


def check_int4_weights(fn: str, qweight, scales, zeros, group_size) -> tuple[int, int]:
    """Shapes and dtypes of the quantized weight; returns ``(K, N)``."""
    if not all(isinstance(t, torch.Tensor) for t in (qweight, scales, zeros)):
        _fail(fn, "qweight, scales and zeros must be tensors")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        _fail(fn, f"qweight must be int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        _fail(fn, f"group_size must be a positive multiple of 8, got {group_size!r}")
    if k % group_size:
        _fail(fn, f"group_size {group_size} does not divide K={k}")
    groups = (k // group_size, n)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != groups:
            _fail(fn, f"{name} must be [K // group_size, N] = {groups} for qweight {tuple(qweight.shape)}, "
                      f"got {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            _fail(fn, f"{name} must be one of {_DTYPES}, got {t.dtype}")
        if t.device != qweight.device:
            _fail(fn, f"{name} is on {t.device}, qweight on {qweight.device}")
    if zeros.dtype != scales.dtype:
        _fail(fn, f"zeros dtype {zeros.dtype} != scales dtype {scales.dtype}")
    return k, n


def _check_inputs(fn: str, x, qweight, scales, zeros, group_size, bias) -> tuple[int, int]:
    k, n = check_int4_weights(fn, qweight, scales, zeros, group_size)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(fn, f"x must be a 2-D tensor [M, K], got {getattr(x, 'shape', type(x))}")
    if x.shape[1] != k:
        _fail(fn, f"x has K={x.shape[1]}, qweight {tuple(qweight.shape)} holds K={k}")
    if x.dtype not in _DTYPES or scales.dtype != x.dtype:
        _fail(fn, f"x, scales and zeros must share one dtype of {_DTYPES}, got {x.dtype} and {scales.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,) or bias.dtype != x.dtype:
            _fail(fn, f"bias must be [N={n}] in {x.dtype}, got {getattr(bias, 'dtype', type(bias))} "
                      f"{tuple(getattr(bias, 'shape', ()))}")
        if bias.device != x.device:
            _fail(fn, f"bias is on {bias.device}, x on {x.device}")
    if qweight.device != x.device:
        _fail(fn, f"qweight is on {qweight.device}, x on {x.device}")
    return k, n


def dequantize_int4_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """The dense weight ``W [N, K]`` in ``scales``' dtype (computed in float32, rounded once)."""
    k, _ = check_int4_weights("dequantize_int4_ref", qweight, scales, zeros, group_size)
    group = torch.arange(k, device=qweight.device) // group_size  # the group of each input channel
    q = unpack_int4(qweight).to(torch.float32)
    w = (q - zeros.to(torch.float32)[group]) * scales.to(torch.float32)[group]  # [K, N]
    return w.t().contiguous().to(scales.dtype)


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` from :func:`dequantize_int4_ref`; the product and the bias
    in float32, one rounding to ``x``'s dtype. Also the CPU backend."""
    _check_inputs("w4a16_matmul_ref", x, qweight, scales, zeros, group_size, bias)
    w = dequantize_int4_ref(qweight, scales, zeros, group_size)
    y = x.to(torch.float32) @ w.to(torch.float32).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@_jit(do_not_specialize=("M",))
def _w4a16_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_qk, stride_sg, stride_zg, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile over the K range of split ``program_id(2)``. With
    ``SPLIT_K == 1`` it writes ``y`` (bias added, cast); else an fp32 partial at
    ``out + split * stride_split``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    # A tile inside one group loads one row of scales and zeros; the host picks BLOCK_K to make
    # that so (it divides group_size, and then K too) whenever a power of two >= 16 divides it.
    ONE_GROUP: tl.constexpr = GROUP_SIZE % BLOCK_K == 0

    # Split ranges are whole BLOCK_K tiles; the host sizes SPLIT_K so that none is empty.
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + tiles_per_split * BLOCK_K)

    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_begin + offs_k)[None, :]
    q_ptrs = qweight_ptr + (k_begin // 8 + offs_p)[:, None] * stride_qk + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if ONE_GROUP:
            a = tl.load(x_ptrs, mask=m_valid[:, None], other=0.0)
            packed = tl.load(q_ptrs, mask=n_valid[None, :], other=0)
            group = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        else:
            k_valid = k0 + offs_k < K
            a = tl.load(x_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            packed = tl.load(q_ptrs, mask=(k0 // 8 + offs_p < K // 8)[:, None] & n_valid[None, :], other=0)
            group = tl.minimum(k0 + offs_k, K - 1) // GROUP_SIZE
            g_ptrs = group[:, None] * stride_sg + offs_n[None, :]
            s = tl.load(scales_ptr + g_ptrs, mask=n_valid[None, :], other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + group[:, None] * stride_zg + offs_n[None, :], mask=n_valid[None, :],
                        other=0.0).to(tl.float32)
        # [BLOCK_K // 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]: row 8p + j is nibble j of packed row p.
        q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
        # Rounded once to the activation dtype, as dequantize_int4_ref does.
        w = ((q.to(tl.float32) - z) * s).to(x_ptr.dtype.element_ty)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        q_ptrs += (BLOCK_K // 8) * stride_qk

    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        out_ptrs = out_ptr + pid_k.to(tl.int64) * stride_split + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=mask)


@_jit(do_not_specialize=("M",))
def _split_k_reduce_kernel(partial_ptr, bias_ptr, out_ptr, M, N, stride_om,
                           SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y[m] = sum_s partial[s, m] (+ bias)``, the splits added in order (bit-reproducible)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * M + row) * N + cols, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=valid)


class W4A16Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int


# Launch settings per shape class, keyed by the largest M each covers:
# (max_m, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). To be tuned by a sweep on the H200;
# so far a bf16 check on 4096x4096, 28672x4096 and 4096x14336 (group 128) picked 64-row tiles
# from M = 17 on (32-row ones ran 1.5x slower at M = 64) and 3 stages; the prefill row is untuned.
_CONFIGS = (
    (16, 16, 64, 128, 4, 3),  # decode: weight-bandwidth bound; split-K fills the GPU
    (256, 64, 128, 64, 4, 3),
    (None, 128, 128, 64, 8, 3),  # prefill
)
# Split K while the output tiles number under _SPLIT_K_PROGRAMS_PER_SM per SM: on the H200 a
# 4096x4096 layer at M = 64 ran in 15 us with 8 splits against 44 us unsplit (32 tiles on 132
# SMs), and at M = 256 in 42 us with 4 against 52; with 896 tiles (28672 wide, M = 256) one pass won.
_SPLIT_K_MAX_M = 256
_SPLIT_K_PROGRAMS_PER_SM = 4
_SPLIT_K_MIN_TILES = 4  # K tiles each split streams at least, so the partials stay cheap
_SPLIT_K_MAX = 8


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def w4a16_config(m: int, n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device,
                 split_k: int | None = None) -> W4A16Config:
    """The launch settings :func:`w4a16_matmul` uses for this shape (``split_k`` None: by heuristic)."""
    _, block_m, block_n, block_k, num_warps, num_stages = next(c for c in _CONFIGS if c[0] is None or m <= c[0])
    # A BLOCK_K that divides group_size keeps each tile inside one group (one scale row per tile).
    fitting = min(block_k, _largest_pow2_divisor(group_size))
    if fitting >= 16:
        block_k = fitting
    elif k < block_k:  # odd group sizes take the per-row scale path; masks cover K's tail
        block_k = max(16, triton.next_power_of_2(k))
    elem = torch.empty((), dtype=dtype).element_size()
    if elem == 4:  # fp32 tiles need twice the shared memory of 16-bit ones
        block_n = min(block_n, 64)
    # Pipelined x and packed-weight tiles (and, for tiles spanning groups, per-row scale and zero
    # tiles) plus one dequantized tile; fewer stages where a GPU has less shared memory than an H200.
    per_row_scales = group_size % block_k != 0

    def smem(stages):
        weights = block_k // 8 * block_n * 4 + (2 * block_k * block_n * elem if per_row_scales else 0)
        return stages * (block_m * block_k * elem + weights) + block_k * block_n * elem

    while num_stages > 2 and smem(num_stages) > max_shared_memory(device):
        num_stages -= 1
    k_tiles = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = 1
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        target = _SPLIT_K_PROGRAMS_PER_SM * num_sms(device)
        if m <= _SPLIT_K_MAX_M and tiles < target:
            want = 1 << (triton.cdiv(target, tiles).bit_length() - 1)  # a power of two at most that
            split_k = max(1, min(want, k_tiles // _SPLIT_K_MIN_TILES, _SPLIT_K_MAX))
    # No empty splits: every split writes its partial, and the reduction reads each.
    split_k = max(1, min(split_k, k_tiles))
    split_k = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split_k))
    return W4A16Config(block_m, block_n, block_k, num_warps, num_stages, split_k)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *,
                 split_k: int | None = None) -> torch.Tensor:
    """Triton version of :func:`w4a16_matmul_ref`. ``split_k``: None picks by shape (splits only
    for M <= 256 with too few output tiles to fill the GPU); 1 forces one pass; > 1 asks for that
    many K splits (fewer where K has fewer tiles)."""
    if triton is None:
        raise RuntimeError("w4a16_matmul: Triton is not installed; use w4a16_matmul_ref")
    k, n = _check_inputs("w4a16_matmul", x, qweight, scales, zeros, group_size, bias)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        _fail("w4a16_matmul", f"split_k must be None or an int >= 1, got {split_k!r}")
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t.stride(-1) != 1:
            _fail("w4a16_matmul", f"{name} needs a contiguous last dimension, strides {t.stride()}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = w4a16_config(m, n, k, group_size, x.dtype, x.device, split_k)
    _launch(x, qweight, scales, zeros, group_size, bias, out, cfg)
    return out


def _launch(x, qweight, scales, zeros, group_size, bias, out, cfg: W4A16Config) -> None:
    m, k = x.shape
    n = out.shape[1]
    bias_arg = bias.contiguous() if bias is not None else scales  # never read without HAS_BIAS
    target = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, bias_arg, target,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0), m * n,
        GROUP_SIZE=group_size, SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            target, bias_arg, out, m, n, out.stride(0),
            SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
