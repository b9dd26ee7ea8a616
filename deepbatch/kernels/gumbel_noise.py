"""The Gumbel noise of the filtered sampling kernels (``sample_top_k_top_p.py``, whose module
docstring defines the counters, and ``sample_rejection.py``): both draw the same noise for the same
element, so a token one of them samples is the token the other samples."""

from __future__ import annotations

from deepbatch.kernels.common import jit as _jit, tl, triton

if triton is not None:
    from triton.language.random import philox as _philox, uint_to_uniform_float as _to_uniform
else:  # the kernels are never launched without Triton
    _philox = _to_uniform = None


@_jit
def _philox_words(quad, seeded, key0, pos, philox_offset, row, vocab):
    """The four Philox outputs for quads ``quad`` of ``row``: counter
    ``(philox_offset + row * ceil(V / 4) + quad)`` as (lo, hi, 0, 0) under the process key, or
    ``(quad, pos_lo, pos_hi, SEEDED_TAG)`` under the row's own seed."""
    counter = philox_offset + row * ((vocab + 3) // 4) + quad
    zero = (quad * 0).to(tl.uint32)
    c0 = tl.where(seeded, quad.to(tl.uint32), counter.to(tl.uint32))
    c1 = tl.where(seeded, zero + (pos & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32))
    c2 = tl.where(seeded, zero + (pos >> 32).to(tl.uint32), zero)
    c3 = tl.where(seeded, zero + 0x5EED5EED, zero)  # SEEDED_TAG
    return _philox(key0, c0, c1, c2, c3)


@_jit
def _score(x, kept, r):
    g = tl.clamp(-tl.log(_to_uniform(r)), 2.9802322387695312e-08, 32.0)  # -log(u) in [2**-25, 32]
    return tl.where(kept, x - tl.log(g), float("-inf"))


@_jit
def gumbel_score(x, kept, cols, seeded, key0, pos, philox_offset, row, vocab):
    """``x + Gumbel`` where kept, -inf elsewhere; column ``v`` takes lane ``v % 4`` of its Philox
    counter. Each element evaluates its own counter: with no fixed quad layout the same code
    serves a whole row, a tile of it and compacted candidates."""
    lane = cols % 4
    r0, r1, r2, r3 = _philox_words(cols // 4, seeded, key0, pos, philox_offset, row, vocab)
    return _score(x, kept, tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3))))


@_jit
def gumbel_score_quads(x, kept, quad, seeded, key0, pos, philox_offset, row, vocab):
    """:func:`gumbel_score` over a ``[QUADS, 4]`` tile whose line ``q`` holds columns
    ``4 * quad[q]`` to ``4 * quad[q] + 3``: the same noise, one Philox evaluation per quad
    instead of one per element."""
    r0, r1, r2, r3 = _philox_words(quad, seeded, key0, pos, philox_offset, row, vocab)
    lane = tl.arange(0, 4)[None, :]
    r = tl.where(lane == 0, r0[:, None],
                 tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])))
    return _score(x, kept, r)
