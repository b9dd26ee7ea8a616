"""FP8 GEMMs through cuBLASLt (``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``): the
library paths of ``kernels/w8a8_fp8_gemm.py``, which checks the operands and chooses between
these and its Triton kernels. Two scalings:

* row-wise, one scale per token and one per output channel (FP8_DYNAMIC, online FP8): applied
  after the dot product, as every cuBLASLt FP8 GEMM on Hopper can;
* DeepSeek's block-wise, 1 x 128 activation groups and 128 x 128 weight blocks: applied per K
  block inside the GEMM (CUDA >= 12.9, SM90), with the scale layouts below.
"""

from __future__ import annotations

import torch

_CUBLAS_BLOCK = 128  # cuBLASLt's block scaling: 1 x 128 activation, 128 x 128 weight blocks


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def scaled_mm_v2():
    """``(torch.nn.functional.scaled_mm, ScalingType)``, the form that names each operand's scaling
    (torch >= 2.10), or None."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    recipe = getattr(torch.nn.functional, "ScalingType", None)
    return None if fn is None or recipe is None else (fn, recipe)


def _torch_has_block_scaled_mm() -> bool:
    from torch.torch_version import TorchVersion

    cuda = torch.version.cuda
    return (hasattr(torch, "_scaled_mm") and TorchVersion(torch.__version__) >= (2, 9) and cuda is not None
            and tuple(int(p) for p in cuda.split(".")[:2]) >= (12, 9))


def cublas_block_unsupported(x_q, w_q, block_size, out_dtype) -> str | None:
    """Why cuBLASLt's DeepSeek-style FP8 GEMM cannot take this call (None: it can)."""
    (_, k), n = x_q.shape, w_q.shape[0]
    if tuple(block_size) != (_CUBLAS_BLOCK, _CUBLAS_BLOCK):
        return f"takes 128 x 128 weight blocks only, got {tuple(block_size)}"
    if n % _CUBLAS_BLOCK or k % _CUBLAS_BLOCK:
        return f"needs N and K multiples of 128, got N={n}, K={k}"
    if out_dtype != torch.bfloat16:
        return f"writes bfloat16 only, got {out_dtype}"
    if not w_q.is_contiguous():
        return f"needs a contiguous w_q, strides {w_q.stride()}"
    if not x_q.is_cuda:
        return f"needs CUDA tensors, got {x_q.device}"
    if not _torch_has_block_scaled_mm():
        return (f"needs torch >= 2.9 built with CUDA >= 12.9, this is torch {torch.__version__} "
                f"with CUDA {torch.version.cuda}")
    cap = torch.cuda.get_device_capability(x_q.device)
    if cap != (9, 0):
        return f"runs on SM90 (Hopper) only, {x_q.device} is SM{cap[0]}{cap[1]}"
    if (k // _CUBLAS_BLOCK) % 4 and scaled_mm_v2() is None:
        # torch._scaled_mm infers the scaling from the scale shapes and, depending on the version,
        # takes the weight scales unpadded: with K / 128 not a multiple of 4 cuBLASLt then reads
        # them at the wrong pitch and answers wrongly without an error.
        return (f"with K / 128 = {k // _CUBLAS_BLOCK} blocks (not a multiple of 4) needs "
                f"torch.nn.functional.scaled_mm (torch >= 2.10), this is torch {torch.__version__}")
    return None


def cublas_block_operands(x_q, x_s, w_q, w_s):
    """``(a, scale_a, scale_b)``: the operands of ``x_q @ w_q^T`` in the layouts cuBLASLt's block
    scaling reads. It takes a pointer and no leading dimension for each scale tensor:

    * activation scales per token and 128 columns, column-major ``[M4, K/128]`` (stride
      ``(1, M4)``) with ``M4`` = M rounded up to a multiple of 4, so that each column starts on
      16 bytes: ``x_q`` gets zero rows up to ``M4`` (their output rows are dropped);
    * weight scales per 128 x 128 block, K-major ``[L4, N/128]`` (stride ``(1, L4)``), each block
      column padded to ``L4`` = K/128 rounded up to a multiple of 4.

    Only the padding (a copy when M or K/128 is not a multiple of 4) and the scale transpose are
    done per call; ``w_q`` is used as it is."""
    (m, k), n = x_q.shape, w_q.shape[0]
    blocks, m4 = k // _CUBLAS_BLOCK, _round_up(m, 4)
    if m4 != m:
        a = x_q.new_zeros(m4, k)
        a[:m] = x_q
        scale_a = x_s.new_zeros(blocks, m4)
        scale_a[:, :m] = x_s.t()
        scale_a = scale_a.t()
    else:
        a = x_q.contiguous()
        scale_a = x_s.t().contiguous().t()
    padded = _round_up(blocks, 4)
    if padded != blocks:
        scale_b = w_s.new_zeros(n // _CUBLAS_BLOCK, padded)
        scale_b[:, :blocks] = w_s
    else:
        scale_b = w_s.contiguous()
    return a, scale_a, scale_b.t()


def cublas_block_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype):
    m, n = x_q.shape[0], w_q.shape[0]
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x_q.device)
    a, scale_a, scale_b = cublas_block_operands(x_q, x_s, w_q, w_s)
    v2 = scaled_mm_v2()
    if v2 is not None:
        scaled_mm, recipe = v2
        out = scaled_mm(a, w_q.t(), scale_a, recipe.BlockWise1x128, scale_b, recipe.BlockWise128x128,
                        output_dtype=out_dtype)
    else:  # K / 128 is a multiple of 4 (cublas_block_unsupported): no padding, either layout rule
        out = torch._scaled_mm(a, w_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[:m]


def cublas_channel_applies(x_q, x_s, w_q, w_s, out_dtype) -> bool:
    """cuBLASLt's FP8 GEMM with row-wise scales (``torch._scaled_mm``) takes bf16 output, one
    scale per token and per output channel, and K and N multiples of 16 on contiguous operands."""
    (m, k), n = x_q.shape, w_q.shape[0]
    return (hasattr(torch, "_scaled_mm") and x_q.is_cuda and out_dtype == torch.bfloat16 and m > 0
            and k % 16 == 0 and n % 16 == 0 and x_s.numel() == m and w_s.numel() == n
            and x_q.is_contiguous() and w_q.is_contiguous())


def cublas_channel_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype):
    """``x_q @ w_q^T`` scaled per token and per output channel, by cuBLASLt (where
    :func:`cublas_channel_applies`)."""
    m, n = x_q.shape[0], w_q.shape[0]
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s.reshape(m, 1).float(), scale_b=w_s.reshape(1, n).float(),
                            out_dtype=out_dtype)
