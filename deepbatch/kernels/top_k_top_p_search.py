"""The threshold search of ``sample_top_k_top_p.py`` (its module docstring has the whole
algorithm): a row's logits as order-preserving int32 keys, and a bisection over those keys for
the smallest one top-k or top-p keeps, first over the whole row in tiles, then over the few
candidates it compacted once they fit in registers. No sort of the vocabulary anywhere."""

from __future__ import annotations

from deepbatch.kernels.common import jit as _jit
from deepbatch.kernels.common import tl

# Keys spelled as literals below: -2139095041 is the key of -inf (0xFF800000 with its magnitude
# bits flipped), -2139095042 (_KEY_PAD) sits below every value (lanes past the vocab), 2**31 - 1
# above every value.


@_jit
def load_row(base, cols, vocab, inv_t, m):
    """float32 ``x = logits * inv_t`` with NaN as -inf; its order-preserving int32 key (lanes
    past the vocab: ``_KEY_PAD``, below every value); ``e = exp(x - m)``, 1 at the max itself
    (also when m is +-inf) and 0 past the vocab."""
    valid = cols < vocab
    x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
    x = tl.where(x != x, float("-inf"), x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)  # -0.0 and +0.0 are one value
    key = tl.where(valid, key, -2139095042)  # _KEY_PAD
    e = tl.where(valid, tl.where(x == m, 1.0, tl.exp(x - m)), 0.0)
    return x, key, e


@_jit
def load_candidates(cand_key_row, cand_col_row, idx, n_cand, m):
    """Candidates ``idx`` of a compacted row: x (back from its key, bit for bit), key (``_KEY_PAD``
    past ``n_cand``), e and column."""
    valid = idx < n_cand
    key = tl.load(cand_key_row + idx, mask=valid, other=-2139095042)
    col = tl.load(cand_col_row + idx, mask=valid, other=0)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    x = tl.where(valid, bits.to(tl.float32, bitcast=True), float("-inf"))
    e = tl.where(valid, tl.where(x == m, 1.0, tl.exp(x - m)), 0.0)
    return x, key, e, col


@_jit
def threshold_search(base, tmax_row, cand_key_row, cand_col_row, n_tiles, vocab, inv_t, m, lo, hi, lo_mass, n_cand,
                     k, target, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr,
                     CAP: tl.constexpr):
    """The largest key ``tau`` in ``[lo, hi)`` with ``count(key >= tau) >= k`` (BY_COUNT) or
    ``mass(key >= tau) >= target``, given the predicate holds at ``lo`` and fails at ``hi``.
    Returns ``tau``, ``mass(key >= tau)`` and ``n_cand``.

    A pass takes, for each of ``NB`` boundaries over ``[lo, hi]``: the count and mass at or above
    it, the smallest key at or above it and the largest key below it. The first pass puts them at
    ``m - 32 * s**2`` for s evenly over (1, 0) (where top-k and top-p cuts fall in practice), later
    ones evenly in key space (at least NB - 1 fold narrower each). Tiles whose max key is below
    ``lo`` hold nothing at or above a boundary, nor the largest key below the boundary the search
    keeps (an element lies between it and the one before), so they are skipped.

    Once at most ``CAP`` elements are at or above ``lo`` (``n_cand >= 0``), they are compacted,
    in column order, into the row's candidate buffer; every later pass, search and the draw read
    that buffer instead of the row (no kept element can lie below ``lo``)."""
    j = tl.arange(0, NB)
    sub = tl.arange(0, SUB)
    frac = (NB - 1 - j).to(tl.float32) / (NB - 1)
    ladder_x = m - 32.0 * frac * frac
    bits = ladder_x.to(tl.int32, bitcast=True)
    ladder = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    passes = tl.full([], 0, dtype=tl.int32)
    while hi - lo > 1:
        even = lo + ((hi - lo) * j) // (NB - 1)
        bnd = tl.where(passes == 0, tl.minimum(tl.maximum(ladder, lo), hi), even)
        bnd = tl.where(j == 0, lo, tl.where(j == NB - 1, hi, bnd)).to(tl.int32)
        passes += 1
        # per-lane partials, reduced once after the pass
        cnt_acc = tl.full([SUB, NB], 0, dtype=tl.int32)
        mass_acc = tl.full([SUB, NB], 0, dtype=tl.float32)
        above_acc = tl.full([SUB, NB], 2147483647, dtype=tl.int32)
        below_acc = tl.full([SUB, NB], -2139095042, dtype=tl.int32)
        if n_cand >= 0:
            for c in range((n_cand + SUB - 1) // SUB):
                _, key, e, _ = load_candidates(cand_key_row, cand_col_row, c * SUB + sub, n_cand, m)
                ge = key[:, None] >= bnd[None, :]
                cnt_acc += ge.to(tl.int32)
                mass_acc += tl.where(ge, e[:, None], 0.0)
                above_acc = tl.minimum(above_acc, tl.where(ge, key[:, None], 2147483647))
                below_acc = tl.maximum(below_acc, tl.where(ge, -2139095042, key[:, None]))
        else:
            for t in range(n_tiles):
                if tl.load(tmax_row + t) >= lo:
                    for q in tl.static_range(BLOCK // SUB):
                        _, key, e = load_row(base, t * BLOCK + q * SUB + sub, vocab, inv_t, m)
                        ge = key[:, None] >= bnd[None, :]
                        cnt_acc += ge.to(tl.int32)
                        mass_acc += tl.where(ge, e[:, None], 0.0)
                        above_acc = tl.minimum(above_acc, tl.where(ge, key[:, None], 2147483647))
                        below_acc = tl.maximum(below_acc, tl.where(ge, -2139095042, key[:, None]))
        cnt = tl.sum(cnt_acc, axis=0)
        mass = tl.sum(mass_acc, axis=0)
        above = tl.min(above_acc, axis=0)
        below = tl.max(below_acc, axis=0)
        if BY_COUNT:
            ok = cnt >= k
        else:
            ok = mass >= target
        ok = (ok | (j == 0)) & (j < NB - 1)  # the invariant, whatever rounding says
        b = tl.min(tl.where(ok, NB, j))  # the first boundary where it fails; it holds at b - 1
        # Tighten to the elements inside [bnd[b-1], bnd[b]): the predicate is the same at the
        # smallest of them as at bnd[b-1], and fails just above the largest.
        lo = tl.max(tl.where(j == b - 1, above, -2147483647)).to(tl.int64)
        lo_mass = tl.max(tl.where(j == b - 1, mass, 0.0))
        lo_cnt = tl.max(tl.where(j == b - 1, cnt, 0))
        hi = tl.max(tl.where(j == b, below, -2147483647)).to(tl.int64) + 1
        if (n_cand < 0) & (lo_cnt <= CAP):
            n = tl.full([], 0, dtype=tl.int32)
            offs = tl.arange(0, BLOCK)
            for t in range(n_tiles):
                if tl.load(tmax_row + t) >= lo:
                    _, key, _ = load_row(base, t * BLOCK + offs, vocab, inv_t, m)
                    take = key >= lo
                    at = n + tl.cumsum(take.to(tl.int32), axis=0) - 1
                    fits = take & (at < CAP)  # always (the count said so); never write past the buffer
                    tl.store(cand_key_row + at, key, mask=fits)
                    tl.store(cand_col_row + at, t * BLOCK + offs, mask=fits)
                    n += tl.sum(take.to(tl.int32))
            n_cand = n
    return lo, lo_mass, n_cand
