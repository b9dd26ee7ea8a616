"""Random noise for seeded requests: the Philox stream the sampling kernels draw from.

A seeded request's t-th sampled token of choice ``i`` (``n > 1`` runs one request per choice)
takes the Exp(1) noise of token ``v`` from Philox4x32-10 keyed by the request's 64-bit seed, at
the counter ``(v // 4, t, i, SEEDED_TAG)``, lane ``v % 4`` (``kernels/sample_top_k_top_p.py``,
whose ``positions`` word carries ``t`` in its low 32 bits and ``i`` in its high ones: see
:func:`stream_position`). It is a pure function of ``(seed, i, t, v)``: the same whatever else
shares the batch, after preemption and recompute, under async scheduling, on the CPU and the
GPU, and whether the torch sampler or the kernel samples the row. Seeds that agree modulo
``2**32`` are different keys (both key words are used); choice ``i`` of seed ``s`` is a
different stream from choice 0 of seed ``s + i``.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.sample_top_k_top_p import philox_uniforms_ref, seed_as_int64

# The clamps of -log(u) of the kernels (kernels/sample.py says why).
_E_MIN = 2.0 ** -25
_E_MAX = 32.0


def stream_position(output_position: int, choice: int) -> int:
    """The ``positions`` word of the sampling kernel for a seeded row: the output position in the
    low 32 bits, the choice index in the high ones."""
    if not 0 <= output_position < 2 ** 32 or not 0 <= choice < 2 ** 31:
        raise ValueError(f"seeded stream: position {output_position} or choice {choice} out of range")
    return output_position | (choice << 32)


def seeded_exponential(keys: list[tuple[int, int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise ``[len(keys), vocab_size]`` (float32), one row per ``(seed, stream_position)``;
    ``seed`` is in ``[0, 2**64)``."""
    seeds = torch.tensor([seed_as_int64(s) for s, _ in keys], dtype=torch.int64, device=device)
    positions = torch.tensor([p for _, p in keys], dtype=torch.int64, device=device)
    seeded = torch.ones(len(keys), dtype=torch.bool, device=device)
    u = philox_uniforms_ref(vocab_size, seeds, positions, seeded, 0, 0)
    return (-u.log()).clamp(_E_MIN, _E_MAX)
