"""Top-k, top-p, min-p and seeded sampling by rejection: the tokens of ``sample_top_k_top_p.py``
at the cost of one or two parallel passes over the logits.

``sample_top_k_top_p`` finds each row's kept set ``K`` (its module docstring has the definition)
with one program per row, several passes over that row in sequence: on a 152k vocabulary a row
takes about a millisecond however many SMs sit idle. This file gets the same token with programs
over (row, tile), from two facts:

* ``K`` is an upper set of the scaled logits ``x``: when a token is kept, so is every larger one
  (top-k keeps the largest, top-p the most likely, min-p those above a fraction of the top).
* The token drawn is ``argmax over K of x_v + g_v``, with ``g_v`` the element's Gumbel noise: a
  fixed function of the row's key and the column (``gumbel_noise.py``). So if the argmax ``w``
  over a larger set ``C`` lies in ``K``, it is the argmax over ``K`` too, with the same noise.

Each row keeps a floor ``lo`` with ``K`` inside ``C = {x >= lo}``, starting at the k-th largest
``x`` (``torch.topk``) for a top-k row and at ``-inf`` for the others. A round:

1. pass A: each tile's best ``x + g`` over ``C`` (and ``e = exp(x - m) >= min_p`` once the row
   max ``m`` is known) and its first column; in round 0 also each tile's max and ``sum exp``
   over the top-k set, for ``m`` and that set's mass ``Z_k``. ``w``: the row's best.
2. ``w`` in ``K``? min-p: ``e_w >= min_p``. top-p: pass B sums the mass strictly above ``x_w``;
   kept when it is below ``p * Z_k`` (or ``w`` is the max).
3. kept: the row is done with ``w``. Not kept: ``lo`` moves just above ``x_w`` (``K`` is an upper
   set, so no kept token is at or below it) and the row takes another round.

A round accepts a top-p row with probability at least ``p`` (the mass of ``K`` over that of ``C``),
so most rows finish in round 0 and a few take one more. Rows still open after ``rounds`` rounds go
to ``sample_top_k_top_p``, which skips the finished ones and gives the same token for the rest.
Greedy rows (temperature 0) take the argmax of their raw logits in round 0 (NaN as +inf, the
lowest column on ties), as there.

The masses are float32 sums in another order than ``sample_top_k_top_p``'s, so a token whose mass
above sits within rounding of ``p * Z_k`` may be judged differently by the two (the torch
reference sums in float64); every other token is the same.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton
from deepbatch.kernels.gumbel_noise import gumbel_score_quads
from deepbatch.kernels.sample_top_k_top_p import check_sampling_inputs, sample_top_k_top_p


# Launch arguments are few on purpose: a Triton launch from Python costs tens of microseconds,
# more with each argument, and a step launches these kernels up to seven times. Per-row inputs
# and per-row work come as [n, S] tables, per-tile work as one [4, S, tiles] table:
#   fparams: temperature, top_p, min_p        iparams (int64): top_k, seed, position, seeded
#   work: lo (the floor), m (row max), Z_k, x_w     state (int32): done, active, arrivals A, arrivals B
#   tile_work: best score, tile max, tile mass, mass above x_w


@_jit(do_not_specialize=("philox_seed", "philox_offset"))
def _candidates_kernel(logits_ptr, fparams_ptr, iparams_ptr, kth_ptr, work_ptr, tile_work_ptr, best_idx_ptr, w_ptr,
                       state_ptr, out_ptr, vocab, stride_row, philox_seed: tl.int64, philox_offset: tl.int64,
                       BLOCK: tl.constexpr, TILES: tl.constexpr, FIRST: tl.constexpr, HAS_K: tl.constexpr):
    """Pass A over one tile of an open row: the best ``x + g`` of the candidates and its first
    column (in round 0 also the tile's max and the mass of its top-k set); the last program of
    the row to finish judges the row's winner (``_pick``)."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.num_programs(1)
    S = tl.num_programs(0)
    if tl.load(state_ptr + row) == 0:  # open
        QUADS: tl.constexpr = BLOCK // 4
        quad = tile * QUADS + tl.arange(0, QUADS)
        cols = quad[:, None] * 4 + tl.arange(0, 4)[None, :]  # [QUADS, 4]: one Philox counter a line
        raw = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        temp = tl.load(fparams_ptr + row)
        at = row * tiles + tile
        if temp > 0.0:
            x = raw * tl.math.div_rn(1.0, temp)
            x = tl.where(x != x, float("-inf"), x)
            if FIRST:
                cand = x > float("-inf")
                if HAS_K:  # the floor of a top-k row: its k-th largest x
                    k = tl.load(iparams_ptr + row)
                    if (k > 0) & (k < vocab):
                        cand = cand & (x >= tl.load(kth_ptr + row).to(tl.float32) * tl.math.div_rn(1.0, temp))
                t_max = tl.max(x)
                e_t = tl.where(x == t_max, 1.0, tl.exp(x - t_max))
                tl.store(tile_work_ptr + S * tiles + at, t_max)
                tl.store(tile_work_ptr + 2 * S * tiles + at, tl.sum(tl.where(cand, e_t, 0.0)))
            else:
                m = tl.load(work_ptr + S + row)
                e = tl.where(x == m, 1.0, tl.exp(x - m))
                cand = (x > tl.load(work_ptr + row)) & (e >= tl.minimum(tl.load(fparams_ptr + 2 * S + row), 1.0))
            seeded = tl.load(iparams_ptr + 3 * S + row) != 0
            key0 = tl.where(seeded, tl.load(iparams_ptr + S + row), philox_seed)
            score = gumbel_score_quads(x, cand, quad, seeded, key0, tl.load(iparams_ptr + 2 * S + row), philox_offset,
                                       row, vocab)
        else:  # greedy: the raw argmax, NaN as +inf
            score = tl.where(raw != raw, float("inf"), raw)
        # (max, first column) from order-free reductions (kernels/sample.py says why)
        best = tl.max(score)
        tl.store(tile_work_ptr + at, best)
        tl.store(best_idx_ptr + at, tl.min(tl.where(score == best, cols, 2147483647)).to(tl.int64))
        # acq_rel: the last to arrive sees every tile's stores
        if tl.atomic_add(state_ptr + 2 * S + row, 1) == tiles - 1:
            tl.store(state_ptr + 2 * S + row, 0)
            _pick(row, S, tiles, logits_ptr, fparams_ptr, work_ptr, tile_work_ptr, best_idx_ptr, w_ptr, state_ptr,
                  out_ptr, stride_row, TILES, FIRST)


@_jit
def _pick(row, S, tiles, logits_ptr, fparams_ptr, work_ptr, tile_work_ptr, best_idx_ptr, w_ptr, state_ptr, out_ptr,
          stride_row, TILES: tl.constexpr, FIRST: tl.constexpr):
    """The row's winner ``w`` (in round 0 also its max ``m`` and top-k mass ``Z_k``). Accepted when
    no top-p test is left; marked active for pass B when one is; else ``lo`` rises to ``x_w``.
    Loads of the tiles bypass L1 (``.cg``): other SMs wrote them, and this SM may hold older lines."""
    t = tl.arange(0, TILES)
    tm = t < tiles
    bv = tl.load(tile_work_ptr + row * tiles + t, mask=tm, other=float("-inf"), cache_modifier=".cg")
    bi = tl.load(best_idx_ptr + row * tiles + t, mask=tm, other=0, cache_modifier=".cg")
    first = tl.min(tl.where(bv == tl.max(bv), t, TILES))  # the first tile holding the best
    w = tl.sum(tl.where(t == first, bi, 0))
    temp = tl.load(fparams_ptr + row)
    if FIRST:
        t_max = tl.load(tile_work_ptr + S * tiles + row * tiles + t, mask=tm, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(t_max)
        scale = tl.where(t_max == m, 1.0, tl.exp(t_max - m))
        t_sum = tl.load(tile_work_ptr + 2 * S * tiles + row * tiles + t, mask=tm, other=0.0, cache_modifier=".cg")
        tl.store(work_ptr + S + row, m)
        tl.store(work_ptr + 2 * S + row, tl.sum(tl.where(tm, t_sum * scale, 0.0)))
    else:
        m = tl.load(work_ptr + S + row)
    x_w = tl.load(logits_ptr + row * stride_row + w).to(tl.float32) * tl.math.div_rn(1.0, tl.maximum(temp, 1e-30))
    x_w = tl.where(x_w != x_w, float("-inf"), x_w)
    at_max = x_w == m
    ok = tl.where(at_max, 1.0, tl.exp(x_w - m)) >= tl.minimum(tl.load(fparams_ptr + 2 * S + row), 1.0)
    greedy = temp <= 0.0
    need_p = ok & (at_max == 0) & (greedy == 0) & (tl.load(fparams_ptr + S + row) < 1.0)
    accept = greedy | (ok & (need_p == 0))
    tl.store(out_ptr + row, w, mask=accept)
    tl.store(state_ptr + row, 1, mask=accept)  # done
    tl.store(work_ptr + row, x_w, mask=(ok == 0) & (greedy == 0))  # the floor rises
    tl.store(work_ptr + 3 * S + row, x_w)
    tl.store(w_ptr + row, w)
    tl.store(state_ptr + S + row, need_p.to(tl.int32))  # active: pass B judges it


@_jit
def _mass_above_kernel(logits_ptr, fparams_ptr, work_ptr, tile_work_ptr, w_ptr, state_ptr, out_ptr, vocab, stride_row,
                       BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Pass B over one tile of an active row: the mass of the tokens above ``x_w``. The last
    program of the row judges: top-p keeps ``w`` when that mass is below ``p * Z_k``."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.num_programs(1)
    S = tl.num_programs(0)
    if tl.load(state_ptr + S + row) != 0:  # active
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        raw = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        x = raw * tl.math.div_rn(1.0, tl.load(fparams_ptr + row))
        x = tl.where(x != x, float("-inf"), x)
        m = tl.load(work_ptr + S + row)
        e = tl.where(x == m, 1.0, tl.exp(x - m))
        x_w = tl.load(work_ptr + 3 * S + row)
        above = tile_work_ptr + 3 * S * tiles + row * tiles
        tl.store(above + tile, tl.sum(tl.where(x > x_w, e, 0.0)))
        if tl.atomic_add(state_ptr + 3 * S + row, 1) == tiles - 1:
            tl.store(state_ptr + 3 * S + row, 0)
            t = tl.arange(0, TILES)
            mass = tl.sum(tl.load(above + t, mask=t < tiles, other=0.0, cache_modifier=".cg"))
            kept = mass < tl.load(fparams_ptr + S + row) * tl.load(work_ptr + 2 * S + row)
            tl.store(out_ptr + row, tl.load(w_ptr + row), mask=kept)
            tl.store(state_ptr + row, 1, mask=kept)  # done
            tl.store(work_ptr + row, x_w, mask=kept == 0)  # the floor rises
            tl.store(state_ptr + S + row, 0)  # no longer active


def sample_rejection(
    logits: torch.Tensor,  # [S, V] float32, bfloat16 or float16
    temperature: torch.Tensor,  # [S] float32, 0 = greedy
    top_k: torch.Tensor,  # [S] int32, <= 0 or >= V: off
    top_p: torch.Tensor,  # [S] float32, >= 1: off
    min_p: torch.Tensor,  # [S] float32, 0: off
    seeds: torch.Tensor,  # [S] int64 (seed_as_int64), read where seeded
    positions: torch.Tensor,  # [S] int64, read where seeded
    seeded: torch.Tensor,  # [S] bool
    philox_seed: int,
    philox_offset: int,
    *,
    max_top_k: int | None = None,
    any_top_p: bool | None = None,
    any_min_p: bool | None = None,
    rounds: int = 3,
    block: int = 4096,
) -> torch.Tensor:
    """``sample_top_k_top_p``'s token for every row (module docstring), ``[S]`` int64, queued
    without a host sync when the hints are given: ``max_top_k`` the largest top-k of a sampled row
    (0: none), ``any_top_p`` / ``any_min_p`` whether a sampled row has top-p < 1 / min-p > 0.
    Without them they are read from the tensors (a sync). ``rounds`` and ``block`` change the
    speed, never the tokens. Rows with neither top-p nor min-p finish in round 0 and rows with
    min-p but no top-p in round 1, so those batches launch no more rounds and no fallback."""
    if triton is None:
        raise RuntimeError("sample_rejection: Triton is not installed; use sample_top_k_top_p_ref")
    check_sampling_inputs(logits, temperature, top_k, top_p, min_p, seeds, positions, seeded, philox_seed,
                          philox_offset, 16)
    if block < 16 or block & (block - 1) or rounds < 1:
        raise ValueError(f"sample_rejection: block must be a power of two >= 16 and rounds >= 1, got {block}, {rounds}")
    S, V = logits.shape
    dev = logits.device
    out = torch.empty(S, dtype=torch.int64, device=dev)
    if S == 0:
        return out
    sampled = temperature > 0
    if max_top_k is None:
        max_top_k = int(torch.where(sampled & (top_k < V), top_k, 0).max().item())
    if any_top_p is None:
        any_top_p = bool((sampled & (top_p < 1.0)).any().item())
    if any_min_p is None:
        any_min_p = bool((sampled & (min_p > 0.0)).any().item())
    # A top-k row's floor is its k-th largest x; scaling by 1 / T keeps the order, so the kernel
    # takes the k-th largest raw logit and scales it (a row with a NaN gets a meaningless floor,
    # and its request ends on the NaN anyway).
    kth = out  # any pointer when no row has top-k
    if max_top_k > 0:
        kth = kth_largest(logits, top_k, min(max_top_k, V))
    tiles = triton.cdiv(V, block)
    TILES = triton.next_power_of_2(tiles)
    fparams = torch.stack([temperature, top_p, min_p])
    iparams = torch.stack([top_k.long(), seeds, positions, seeded.long()])
    work = torch.empty(4, S, dtype=torch.float32, device=dev)
    tile_work = torch.empty(4, S, tiles, dtype=torch.float32, device=dev)
    best_idx = torch.empty(S, tiles, dtype=torch.int64, device=dev)
    w = torch.empty(S, dtype=torch.int64, device=dev)
    state = torch.zeros(4, S, dtype=torch.int32, device=dev)
    needed = 2 if any_min_p else 1  # rounds that finish every row without top-p
    for r in range(rounds if any_top_p else min(rounds, needed)):
        _candidates_kernel[(S, tiles)](
            logits, fparams, iparams, kth, work, tile_work, best_idx, w, state, out,
            V, logits.stride(0), philox_seed, philox_offset,
            BLOCK=block, TILES=TILES, FIRST=r == 0, HAS_K=max_top_k > 0, num_warps=8,
        )
        if any_top_p:
            _mass_above_kernel[(S, tiles)](logits, fparams, work, tile_work, w, state, out, V, logits.stride(0),
                                           BLOCK=block, TILES=TILES, num_warps=8)
    if any_top_p or rounds < needed:
        # Rows still open: the one-program-per-row search, which skips the rows done here.
        sample_top_k_top_p(logits, temperature, top_k, top_p, min_p, seeds, positions, seeded, philox_seed,
                           philox_offset, skip=state[0], out=out)
    return out


def kth_largest(logits: torch.Tensor, top_k: torch.Tensor, max_k: int, group: int = 32) -> torch.Tensor:
    """Each row's ``top_k``-th largest logit (``top_k`` clamped to ``[1, max_k]``), as
    ``logits.topk(max_k)`` gives it, at a fraction of its cost on a large vocabulary.

    ``torch.topk`` over a 152k row runs one thread block per row through several radix passes;
    here the row is cut in groups of ``group`` columns. The ``max_k``-th largest group max ``L``
    is at most the ``max_k``-th largest logit (the ``max_k`` best groups each hold a logit >= L),
    and every logit above ``L`` sits in one of those groups (any other group's max is <= L). So
    the ``max_k`` largest logits, ties at ``L`` included, are the ``max_k`` largest of those groups'
    columns (and of the columns past the last whole group): a top-k over ``max_k * group`` columns
    instead of the vocabulary."""
    S, V = logits.shape
    whole = V // group * group
    if whole // group < 4 * max_k:  # few groups: the plain top-k is as cheap
        values = logits.topk(max_k, dim=1).values
    else:
        maxima = logits[:, :whole].reshape(S, whole // group, group).amax(dim=2)
        best = maxima.topk(max_k, dim=1).indices  # [S, max_k] groups
        cols = (best.unsqueeze(2) * group + torch.arange(group, device=logits.device)).flatten(1)
        candidates = logits.gather(1, cols)
        if whole < V:
            candidates = torch.cat([candidates, logits[:, whole:]], dim=1)
        values = candidates.topk(max_k, dim=1).values
    return values.gather(1, (top_k.long().clamp(1, max_k) - 1).unsqueeze(1)).squeeze(1)
