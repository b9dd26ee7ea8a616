"""The dense weight of a W4A16 layer from its packed int4 form, in one pass (``kernels/w4a16_gemm.py``
describes the layout)::

    qweight  int32 [K // 8, N]   scales, zeros  [K // group_size, N]
    ->  W [N, K] in scales' dtype,  W[n, k] = (q(n, k) - zeros[k // g, n]) * scales[k // g, n]

The output is ``F.linear``'s weight layout, so ``F.linear(x, W)`` hands it to cuBLAS as it is. It is
what a W4A16 layer multiplies with at prefill sizes: with thousands of tokens the GEMM is bound by
the tensor cores, and cuBLAS on a 16-bit weight beats the fused 4-bit kernel, whose weight read no
longer matters. Each program reads one ``[BLOCK_K // 8, BLOCK_N]`` tile of packed words (coalesced
along N) and writes the ``[BLOCK_K, BLOCK_N]`` values it holds; the arithmetic is the reference's
(:func:`~deepbatch.kernels.w4a16_gemm.dequantize_int4_ref`: float32, one rounding to the output
dtype), so the two agree bit for bit.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit
from deepbatch.kernels.common import tl, triton
from deepbatch.kernels.w4a16_gemm import check_int4_weights

# Elements each program writes: enough work per program to hide the load latency of a memory-bound
# kernel; at most 128 x 64 values held in registers by 4 warps.
_TILE_ELEMENTS = 8192
_MAX_BLOCK_K = 128


@_jit
def _dequantize_int4_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, out_ptr,
    N, K,
    stride_qk, stride_sg, stride_zg, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``W[n, k]`` for the ``[BLOCK_K, BLOCK_N]`` tile at ``(program_id(0), program_id(1))``."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_p = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # packed rows
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    k_valid = offs_k < K
    # K is a multiple of 8: a packed row inside K holds eight valid input channels.
    packed = tl.load(qweight_ptr + offs_p[:, None] * stride_qk + offs_n[None, :],
                     mask=(offs_p < K // 8)[:, None] & n_valid[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    # [BLOCK_K // 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]: row 8p + j is nibble j of packed row p; the
    # mask drops the sign bits the arithmetic shift smears into the top nibble.
    q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N])
    # The host picks BLOCK_K to divide the group size wherever a power of two >= 16 divides it: the
    # tile then lies in one group and reads one row of scales and zeros.
    if GROUP_SIZE % BLOCK_K == 0:
        group = (pid_k * BLOCK_K) // GROUP_SIZE
        s = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        z = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    else:
        group = tl.minimum(offs_k, K - 1) // GROUP_SIZE
        s = tl.load(scales_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=n_valid[None, :],
                    other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + group[:, None] * stride_zg + offs_n[None, :], mask=n_valid[None, :],
                    other=0.0).to(tl.float32)
    w = ((q.to(tl.float32) - z) * s).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + offs_n[None, :].to(tl.int64) * stride_on + offs_k[:, None]
    tl.store(out_ptrs, w, mask=k_valid[:, None] & n_valid[None, :])


def dequantize_int4_config(n: int, k: int, group_size: int) -> tuple[int, int]:
    """``(BLOCK_K, BLOCK_N)`` for a weight ``[N, K]`` of this group size."""
    fitting = min(_MAX_BLOCK_K, group_size & -group_size)  # the largest power of two dividing it
    if fitting >= 16:
        block_k = fitting
    else:  # odd group sizes read a scale row per input channel; the mask covers K's tail
        block_k = min(_MAX_BLOCK_K // 2, max(16, triton.next_power_of_2(k)))
    block_n = max(16, min(_TILE_ELEMENTS // block_k, triton.next_power_of_2(n)))
    return block_k, block_n


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Triton version of :func:`~deepbatch.kernels.w4a16_gemm.dequantize_int4_ref`: a new
    contiguous ``W [N, K]`` in ``scales``' dtype."""
    if triton is None:
        raise RuntimeError("dequantize_int4: Triton is not installed; use dequantize_int4_ref")
    k, n = check_int4_weights("dequantize_int4", qweight, scales, zeros, group_size)
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"dequantize_int4: {name} needs a contiguous last dimension, strides {t.stride()}")
    out = torch.empty(n, k, dtype=scales.dtype, device=qweight.device)
    if n == 0 or k == 0:
        return out
    block_k, block_n = dequantize_int4_config(n, k, group_size)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequantize_int4_kernel[grid](
        qweight, scales, zeros, out, n, k,
        qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4,
    )
    return out
