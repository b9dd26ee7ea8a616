"""The e4m3 weight formats of ``fp8.py`` and ``fp8_moe.py``: weights quantized per 128 x 128
block (DeepSeek-V3's layout) or per output channel, and whether the Triton kernels run here."""

from __future__ import annotations

import math

import torch

from deepbatch.kernels.common import triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def use_fp8_kernels(x: torch.Tensor) -> bool:
    """The Triton kernels on a GPU with FP8 tensor cores (Ada, Hopper and later); the torch
    reference elsewhere (the CPU, older GPUs), which gives the same numbers more slowly."""
    if not x.is_cuda or triton is None:
        return False
    from deepbatch.kernels.fp8_quant import native_fp8_supported

    return native_fp8_supported(x.device)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q e4m3 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)])`` with ``w ~= w_q * scale``
    per block (each block's largest magnitude maps to 448): DeepSeek-V3's layout."""
    bn, bk = block
    n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(FP8), scale


def quantize_fp8_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q e4m3 [N, K], scale float32 [N, 1])``: one scale per output channel."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
