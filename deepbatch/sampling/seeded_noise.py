"""Counter-based random noise for seeded requests.

A seeded request's t-th sampled token of choice i draws its exponential noise from a pure
function of ``(seed, i, t, token id)``::

    u[v] = (H(H(H(H(v ^ seed_lo) ^ seed_hi) ^ i) ^ t) + 0.5) / 2**32,    q[v] = -log(u[v])

where ``H`` is a 32-bit integer mixer that is a bijection (xor-shifts and odd multiplies), so
for fixed ``(i, t, v)`` two different 64-bit seeds never give the same ``u[v]``: seeds do not
collide modulo 2**32, as they do through ``torch.Generator`` on the CPU. Nothing is stateful, so
the stream is the same whatever else shares the batch, after preemption and recompute, under
async scheduling, and on the CPU and the GPU (integer arithmetic is exact on both). Choice ``i``
of seed ``s`` is a different stream from choice 0 of seed ``s + i``.

The arithmetic runs on int64 tensors holding 32-bit values; products are split into 16-bit
halves so that no intermediate overflows the signed 64-bit range.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) without signed overflow."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection on [0, 2**32) with good avalanche (xor-shift / multiply rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_exponential(keys: list[tuple[int, int, int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise ``[len(keys), vocab_size]`` (float32), one row per ``(seed, choice, step)``.

    ``seed`` is in [0, 2**64); ``choice`` and ``step`` are small non-negative ints."""
    words = torch.tensor(
        [[s & _MASK, s >> 32, c & _MASK, t & _MASK] for s, c, t in keys], dtype=torch.int64, device=device
    )
    h = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0).expand(len(keys), -1)
    for j in range(4):
        h = mix32(h ^ words[:, j : j + 1])
    u = (h.to(torch.float64) + 0.5) * (1.0 / 2**32)  # in (0, 1): never 0, never 1
    return (-torch.log(u)).to(torch.float32)
