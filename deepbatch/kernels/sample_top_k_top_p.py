"""Sampling with temperature, top-k, top-p and min-p in one kernel, with no sort over the vocab.

One program per row. A row whose temperature is 0 is greedy: the argmax of its raw logits (the
lowest index on ties, a NaN counting as +inf), no draws. Every other row works on
``x = logits * (1 / T)`` in float32 (NaN as -inf):

1. max pass: ``m = max x`` and each tile's max (later passes skip tiles that cannot matter);
   sum pass: ``Z = sum e``, ``e = exp(x - m)``.
2. top-k then top-p: each a threshold search over the row's values (below).
3. draw pass: ``argmax over the kept tokens of x + Gumbel`` (Gumbel-max over the kept logits
   draws from their renormalised softmax with no second normalisation).

Passes keep per-lane partials and reduce them once at the end of the pass, not once a tile.

**The kept set** is ``{v : x_v >= tau, e_v >= min_p, x_v > -inf}`` where ``tau`` is found in
the order of the torch sampler (temperature -> top-k -> top-p -> min-p, vLLM V0's order):

* top-k (``0 < k < V``): ``tau_k`` is the k-th largest ``x`` counted with multiplicity, and every
  token equal to it is kept, so ties at the boundary keep more than k tokens.
* top-p (``p < 1``), over the top-k set renormalised: ``tau`` is the largest value with
  ``mass(x >= tau) >= p * mass(x >= tau_k)``, i.e. the smallest set of largest tokens whose mass
  reaches p, with every token tied to its smallest one. Equivalently: a token stays when the mass
  of the tokens strictly above it is below ``p``.
* min-p: ``e_v >= min_p``, i.e. ``p_v >= min_p * p_max``; the ratio does not change under
  renormalisation, so applying it last or first gives the same cut. (vLLM V1 applies min-p
  before top-k/top-p, which changes the mass top-p sees; this kernel matches the torch path.)

**The threshold search** works on the order-preserving integer key of each float32 value (the
bits, with the magnitude bits of negatives flipped; -0.0 keyed as +0.0). It keeps ``lo``
(predicate true: ``count(key >= lo) >= k``, or ``mass(key >= lo) >= target``) and ``hi``
(predicate false). A pass places ``NB`` boundaries over ``[lo, hi]`` and gathers, for each, the
count and mass of the row at or above it, the smallest key at or above it and the largest key
below it. The new interval is the sub-interval where the predicate turns false, tightened to the
keys of the elements inside it; the search ends when one key is left. The first pass puts the
boundaries at ``m - 32 s**2`` (s evenly over (1, 0)), where cuts fall in practice; later passes
space them evenly in key space, so the interval shrinks at least ``NB - 1`` fold a pass (at most
9 passes at ``NB = 16`` over 2**32 keys; the tightening usually ends it in 2 to 5).

Once at most ``max_candidates`` elements lie at or above ``lo``, one more pass compacts them
(key and column, in column order) into a per-row buffer, and every later pass, the second
search and the draw read those few instead of the row: no kept element lies below ``lo``. Rows
whose cut keeps more (a flat row at p = 0.99) stream the row every pass. Either way the kept
set and the draws are the same.

**The uniforms** are Philox4x32-10 (Triton's ``tl.rand4x``): element ``v`` of a row takes lane
``v % 4`` of one counter:

* an unseeded row ``r`` uses key ``philox_seed`` and the 64-bit counter
  ``philox_offset + r * ceil(V / 4) + v // 4`` as the words ``(lo, hi, 0, 0)``, the counters of
  ``kernels/sample.py``, so with no truncation it draws what ``gumbel_sample`` draws.
  A call uses :func:`counters_used` counters from the offset.
* a seeded row uses its own 64-bit seed as the key and the words
  ``(v // 4, position_lo, position_hi, SEEDED_TAG)``: a function of (seed, position, token) alone,
  so it draws the same token whatever batch and row it lands in. The tag keeps these counters apart
  from the unseeded ones (whose last word is 0).

``-log(u)`` is clamped to ``[2**-25, 32]`` as in ``sample.py``, so the noise is finite.

:func:`sample_top_k_top_p_ref` finds the same kept set by sorting and draws from the same Philox
uniforms (:func:`philox4x32_ref`), so both return the same ids.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton
from deepbatch.kernels.gumbel_noise import gumbel_score
from deepbatch.kernels.philox_ref import philox4x32_ref, uniform_ref
from deepbatch.kernels.sample import counters_used
from deepbatch.kernels.top_k_top_p_search import load_candidates, load_row, threshold_search

__all__ = ["check_sampling_inputs", "counters_used", "philox4x32_ref", "sample_top_k_top_p", "sample_top_k_top_p_ref",
           "seed_as_int64"]

SEEDED_TAG = 0x5EED5EED  # last Philox counter word of seeded rows; unseeded rows have 0 there
_E_MIN = 2.0 ** -25  # clamps of -log(u), as in sample.py
_E_MAX = 32.0
# Keys the kernel spells out as literals: -2139095041 is the key of -inf (0xFF800000 with its
# magnitude bits flipped), -2139095042 (_KEY_PAD) sits below every value (lanes past the vocab),
# 2**31 - 1 above every value.

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_OFFSET = 2 ** 62


# -- the kernel ---------------------------------------------------------------------------------


@_jit
def _draw(x, key, e, cols, tau, min_p, seeded, key0, pos, philox_offset, row, vocab, best, best_i):
    """One tile of the draw pass: the kept set (above the top-k/top-p threshold ``tau``, at least
    ``min_p`` of the top probability, finite) and the running per-lane best Gumbel score."""
    kept = (key >= tau) & (e >= min_p) & (x > float("-inf"))
    score = gumbel_score(x, kept, cols, seeded, key0, pos, philox_offset, row, vocab)
    better = score > best
    return kept, tl.where(better, score, best), tl.where(better, cols, best_i)


@_jit(do_not_specialize=("philox_seed", "philox_offset"))
def _sample_top_k_top_p_kernel(
    logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, pos_ptr, seeded_ptr,
    tile_max_ptr, cand_key_ptr, cand_col_ptr, out_ptr, kept_ptr, skip_ptr,
    vocab, stride_row, philox_seed: tl.int64, philox_offset: tl.int64,
    BLOCK: tl.constexpr, SUB: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr, WRITE_KEPT: tl.constexpr,
    SKIP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if SKIP:  # a row another kernel already sampled (sample_rejection.py): leave its id alone
        if tl.load(skip_ptr + row) != 0:
            return
    base = logits_ptr + row * stride_row
    n_tiles = (vocab + BLOCK - 1) // BLOCK
    tmax_row = tile_max_ptr + row * n_tiles
    cand_key_row = cand_key_ptr + row * CAP
    cand_col_row = cand_col_ptr + row * CAP
    offs = tl.arange(0, BLOCK)
    temp = tl.load(temp_ptr + row)
    # per-lane (best score, its first column), reduced once at the end
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK], 0, dtype=tl.int32)
    if temp > 0.0:
        inv_t = tl.math.div_rn(1.0, temp)
        # max pass (and each tile's max key), then sum pass
        m_acc = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for t in range(n_tiles):
            x, key, _ = load_row(base, t * BLOCK + offs, vocab, inv_t, float("inf"))
            tl.store(tmax_row + t, tl.max(key))
            m_acc = tl.maximum(m_acc, x)
        m = tl.max(m_acc)
        z_acc = tl.full([BLOCK], 0, dtype=tl.float32)
        for t in range(n_tiles):
            _, _, e = load_row(base, t * BLOCK + offs, vocab, inv_t, m)
            z_acc += e
        z = tl.sum(z_acc)
        bits = m.to(tl.int32, bitcast=True)
        key_hi = tl.where(m == 0.0, 0, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)).to(tl.int64) + 1

        tau = tl.full([], -2139095041, dtype=tl.int64)  # key of -inf: everything
        z_k = z
        n_cand = tl.full([], -1, dtype=tl.int32)  # no candidate buffer yet
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < vocab):
            tau, z_k, n_cand = threshold_search(base, tmax_row, cand_key_row, cand_col_row, n_tiles, vocab, inv_t, m, tau,
                                       key_hi, z, n_cand, k, 0.0, True, BLOCK, SUB, NB, CAP)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            tau, z_k, n_cand = threshold_search(base, tmax_row, cand_key_row, cand_col_row, n_tiles, vocab, inv_t, m, tau,
                                       key_hi, z_k, n_cand, 0, top_p * z_k, False, BLOCK, SUB, NB, CAP)
        min_p = tl.minimum(tl.load(min_p_ptr + row), 1.0)

        # draw pass, over the candidates when there are some
        seeded = tl.load(seeded_ptr + row) != 0
        pos = tl.load(pos_ptr + row)
        key0 = tl.where(seeded, tl.load(seed_ptr + row), philox_seed)
        if n_cand >= 0:
            for c in range((n_cand + BLOCK - 1) // BLOCK):
                x, key, e, cols = load_candidates(cand_key_row, cand_col_row, c * BLOCK + offs, n_cand, m)
                kept, best, best_i = _draw(x, key, e, cols, tau, min_p, seeded, key0, pos, philox_offset, row,
                                           vocab, best, best_i)
                if WRITE_KEPT:
                    tl.store(kept_ptr + row * vocab + cols, kept, mask=c * BLOCK + offs < n_cand)
        else:
            for t in range(n_tiles):
                tile_key = tl.load(tmax_row + t)
                if (tile_key >= tau) & (tile_key > -2139095041):  # some element kept: above -inf
                    cols = t * BLOCK + offs
                    x, key, e = load_row(base, cols, vocab, inv_t, m)
                    kept, best, best_i = _draw(x, key, e, cols, tau, min_p, seeded, key0, pos, philox_offset, row,
                                               vocab, best, best_i)
                    if WRITE_KEPT:
                        tl.store(kept_ptr + row * vocab + cols, kept, mask=cols < vocab)
    else:
        # greedy: the plain argmax, NaN as +inf
        for t in range(n_tiles):
            cols = t * BLOCK + offs
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)
            better = x > best
            best_i = tl.where(better, cols, best_i)
            best = tl.where(better, x, best)
    # Each lane holds its first column of its max (columns arrive in increasing order per lane);
    # the lowest such column among the lanes holding the overall max is the row's first.
    top = tl.max(best)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_i, 2147483647)).to(tl.int64))


# -- the wrapper --------------------------------------------------------------------------------


def seed_as_int64(seed: int) -> int:
    """A request seed in ``[0, 2**64)`` as the int64 with the same bits (what ``seeds`` holds)."""
    return seed - 2 ** 64 if seed >= 2 ** 63 else seed


def check_sampling_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, seeded, philox_seed,
                          philox_offset, block):
    """The arguments of :func:`sample_top_k_top_p` (and of ``sample_rejection.py``'s, the same)."""
    def fail(msg):
        raise ValueError(f"sample_top_k_top_p: {msg}")

    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        fail(f"logits must be [S, V] of {_DTYPES}, got {logits.dtype} {tuple(logits.shape)}")
    S, V = logits.shape
    if V == 0:
        fail("empty vocabulary")
    if V >= 2 ** 31:
        fail(f"vocabulary of {V} does not fit int32 indices")
    if logits.stride(1) != 1:
        fail(f"logits need a contiguous last dimension, strides {logits.stride()}")
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                           ("seeds", seeds, torch.int64), ("positions", positions, torch.int64),
                           ("seeded", seeded, torch.bool)):
        if not isinstance(t, torch.Tensor) or t.shape != (S,) or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(f"{name} must be {dtype} [{S}], got {got}")
        if t.device != logits.device:
            fail(f"{name} is on {t.device}, logits on {logits.device}")
    if not 0 <= philox_seed < 2 ** 63:
        fail(f"philox_seed {philox_seed} outside [0, 2**63)")
    if not 0 <= philox_offset < _MAX_OFFSET:
        fail(f"philox_offset {philox_offset} outside [0, 2**62)")
    if block < 16 or block & (block - 1):
        fail(f"block must be a power of two >= 16, got {block}")


def sample_top_k_top_p(
    logits: torch.Tensor,  # [S, V] float32, bfloat16 or float16
    temperature: torch.Tensor,  # [S] float32, 0 = greedy
    top_k: torch.Tensor,  # [S] int32, <= 0 or >= V: off
    top_p: torch.Tensor,  # [S] float32, >= 1: off
    min_p: torch.Tensor,  # [S] float32, 0: off
    seeds: torch.Tensor,  # [S] int64, read where seeded (seed_as_int64 of the request's seed)
    positions: torch.Tensor,  # [S] int64, the output position of the token drawn, read where seeded
    seeded: torch.Tensor,  # [S] bool
    philox_seed: int,
    philox_offset: int,
    *,
    block: int = 1024,
    num_boundaries: int = 16,
    max_candidates: int = 2048,
    num_warps: int | None = None,
    return_kept: bool = False,
    skip: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One token per row (module docstring): ``[S]`` int64 ids, queued without a host sync.
    ``return_kept`` also returns the ``[S, V]`` bool kept set of the sampled rows (greedy rows:
    all False). ``block`` (a power of two >= 16), ``num_boundaries`` (a power of two >= 4),
    ``max_candidates`` (the compacted buffer per row; 0: never compact) and ``num_warps``
    change the speed, not the result. ``skip`` (``[S]`` bool or int32, nonzero: skip) leaves the rows it marks alone:
    their ids in ``out`` (``[S]`` int64, written in place when given) are not written."""
    if triton is None:
        raise RuntimeError("sample_top_k_top_p: Triton is not installed; use sample_top_k_top_p_ref")
    check_sampling_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, seeded, philox_seed,
                          philox_offset, block)
    if num_boundaries < 4 or num_boundaries & (num_boundaries - 1):
        raise ValueError(f"sample_top_k_top_p: num_boundaries must be a power of two >= 4, got {num_boundaries}")
    if max_candidates < 0:
        raise ValueError(f"sample_top_k_top_p: max_candidates must be >= 0, got {max_candidates}")
    S, V = logits.shape
    dev = logits.device
    if skip is not None and (skip.shape != (S,) or skip.dtype not in (torch.bool, torch.int32) or skip.device != dev
                             or not skip.is_contiguous()):
        raise ValueError(f"sample_top_k_top_p: skip must be bool or int32 [{S}] on {dev}, got {skip.dtype} "
                         f"{tuple(skip.shape)}")
    if out is None:
        out = torch.empty(S, dtype=torch.int64, device=dev)
    elif out.shape != (S,) or out.dtype != torch.int64 or out.device != dev or not out.is_contiguous():
        raise ValueError(f"sample_top_k_top_p: out must be contiguous int64 [{S}] on {dev}")
    kept = torch.zeros(S, V if return_kept else 1, dtype=torch.bool, device=dev)
    if S:
        tiles = triton.cdiv(V, block)
        tile_max = torch.empty(S, tiles, dtype=torch.int32, device=dev)  # each tile's max key
        cand_key = torch.empty(S, max(max_candidates, 1), dtype=torch.int32, device=dev)
        cand_col = torch.empty_like(cand_key)
        # the boundary passes hold [SUB, NB] partials per lane: about 4096 of each
        sub = min(block, max(16, 4096 // num_boundaries))
        _sample_top_k_top_p_kernel[(S,)](
            logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous(),
            seeds.contiguous(), positions.contiguous(), seeded.contiguous(),
            tile_max, cand_key, cand_col, out, kept, skip if skip is not None else out,
            V, logits.stride(0), philox_seed, philox_offset,
            BLOCK=block, SUB=sub, NB=num_boundaries, CAP=max_candidates, WRITE_KEPT=return_kept,
            SKIP=skip is not None,
            num_warps=num_warps or 8,
        )
    return (out, kept) if return_kept else out


# -- the torch reference ------------------------------------------------------------------------

def philox_uniforms_ref(
    vocab: int, seeds: torch.Tensor, positions: torch.Tensor, seeded: torch.Tensor, philox_seed: int,
    philox_offset: int,
) -> torch.Tensor:
    """``[S, vocab]`` float32: the uniform the kernel gives each element of each row."""
    S = seeds.shape[0]
    dev = seeds.device
    quads = -(-vocab // 4)
    quad = torch.arange(quads, dtype=torch.int64, device=dev).unsqueeze(0)
    row = torch.arange(S, dtype=torch.int64, device=dev).unsqueeze(1)
    counter = philox_offset + row * quads + quad
    sd = seeded.unsqueeze(1)
    pos = positions.unsqueeze(1)
    key = torch.where(sd, seeds.unsqueeze(1), torch.full_like(seeds.unsqueeze(1), philox_seed))
    c0 = torch.where(sd, quad, counter)
    c1 = torch.where(sd, pos, counter >> 32)
    c2 = torch.where(sd, pos >> 32, 0)
    c3 = torch.where(sd, SEEDED_TAG, 0)
    lanes = [uniform_ref(r) for r in philox4x32_ref(key, c0, c1, c2, c3)]
    return torch.stack(lanes, dim=-1).reshape(S, quads * 4)[:, :vocab]


def kept_set_ref(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``[S, V]`` bool: the kept set (module docstring) of the float32 scaled logits ``x`` (no
    NaN), found by sorting, with masses in float64."""
    V = x.shape[1]
    m = x.max(dim=1, keepdim=True).values
    e = torch.where(x == m, torch.ones_like(x), torch.exp(x - m))
    desc, order = x.sort(dim=1, descending=True, stable=True)
    asc = x.sort(dim=1).values
    k = top_k.long().unsqueeze(1)
    k_on = (k > 0) & (k < V)
    tau_k = desc.gather(1, (k - 1).clamp(0, V - 1))
    keep = ~k_on | (x >= tau_k)
    # top-p over the top-k set: a token stays when the mass strictly above it is below p * Z_k
    e_sorted = torch.where(keep.gather(1, order), e.gather(1, order), 0).double()
    before = e_sorted.cumsum(dim=1) - e_sorted
    first = V - torch.searchsorted(asc.contiguous(), desc.contiguous(), right=True)  # count(x > value)
    above = before.gather(1, first)  # the mass before the first token of each tie group
    z_k = e_sorted.sum(dim=1, keepdim=True)
    p = top_p.double().unsqueeze(1)
    keep_sorted = (p >= 1.0) | (above < p * z_k) | (first == 0)  # the max always stays
    keep &= torch.empty_like(keep).scatter_(1, order, keep_sorted)
    return keep & (e >= min_p.clamp(max=1.0).unsqueeze(1)) & (x > float("-inf"))


def sample_top_k_top_p_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    seeded: torch.Tensor,
    philox_seed: int,
    philox_offset: int,
    *,
    return_kept: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_top_k_top_p` in torch: the kept set by sorting, the draws from the same
    Philox uniforms, so the same ids (up to last-ulp differences of ``exp``/``log``)."""
    check_sampling_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, seeded, philox_seed,
                          philox_offset, 16)
    V = logits.shape[1]
    raw = logits.float()
    greedy = ~(temperature > 0)
    inv_t = torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, temperature)).unsqueeze(1)
    x = raw * inv_t
    x = torch.where(torch.isnan(x), float("-inf"), x)
    kept = kept_set_ref(x, top_k, top_p, min_p) & ~greedy.unsqueeze(1)
    u = philox_uniforms_ref(V, seeds, positions, seeded, philox_seed, philox_offset)
    g = (-u.log()).clamp(_E_MIN, _E_MAX)
    score = torch.where(kept, x - g.log(), float("-inf"))
    ids = torch.where(greedy, torch.where(torch.isnan(raw), float("inf"), raw).argmax(dim=1),
                      score.argmax(dim=1))
    return (ids, kept) if return_kept else ids
