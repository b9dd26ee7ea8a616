"""Philox4x32-10 in torch, word for word as Triton's ``tl.philox``/``tl.rand`` compute it, so the
torch references of the sampling kernels draw the kernels' own uniforms (and a kernel's ids can be
held to its reference exactly, not only in distribution)."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a * b) >> 32`` and ``(a * b) mod 2**32`` for 32-bit values in int64 tensors, without
    signed overflow: ``b`` is split into 16-bit halves."""
    lo_part = b * (a & 0xFFFF)
    hi_part = b * (a >> 16)
    t = lo_part + ((hi_part & 0xFFFF) << 16)
    return (hi_part >> 16) + (t >> 32), t & _M32


def philox4x32_ref(key: torch.Tensor, c0, c1, c2, c3) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcast together): the four
    outputs for counter ``(c0, c1, c2, c3)`` and the 64-bit ``key`` (int64, its two halves the
    key words), as Triton's ``philox`` computes them."""
    k0 = key & _M32
    k1 = (key >> 32) & _M32
    c0, c1, c2, c3 = torch.broadcast_tensors(c0 & _M32, c1 & _M32, c2 & _M32, c3 & _M32)
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(0xCD9E8D57, c2)
        hi_a, lo_a = _mulhilo32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def uniform_ref(r: torch.Tensor) -> torch.Tensor:
    """Triton's ``uint_to_uniform_float`` for 32-bit words: the word as int32, folded onto
    ``[0, 2**31)`` by ``~x`` when negative, times the largest float below ``2**-31``."""
    folded = torch.where(r >= 2 ** 31, _M32 - r, r)
    return folded.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)
