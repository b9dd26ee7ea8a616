"""The logprobs a step returns, in one kernel: each row's sampled token's logprob and rank, and its
``k`` most likely tokens with their logprobs, without writing the ``[S, V]`` log-softmax and
without sorting the vocabulary.

One program per (row, tile) reads its tile once for all three: the tile's max and ``sum exp(x -
max)`` (the pieces of the row's logsumexp), how many of its logits beat the sampled token's (the
pieces of its rank), and its own ``k`` largest logits, taken one at a time from registers (``k <=
20``). The last program of a row to finish (an atomic arrival count) combines the tiles: the
logsumexp, the rank, and the ``k`` largest of the tiles' candidates, written as one float32 row

    [logprob of the sampled token, its rank, k logprobs best first, their k token ids]

so the host takes the whole step in one copy (ids and ranks are exact in float32 below 2**24).
``logprobs_topk_ref`` is the torch reference: a logsumexp, a comparison and ``torch.topk``.
On equal logits the kernel lists the lowest column first (``torch.topk`` leaves the order open).
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton

MAX_K = 20  # the most logprobs a request may ask for (SamplingParams caps them at MAX_LOGPROBS)


def logprobs_topk_ref(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """``[S, 2 + 2k]`` float32 rows (module docstring) for ``logits [S, V]`` and the sampled
    ``token_ids [S]``."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = x.gather(1, token_ids.long().unsqueeze(1))
    rank = (x > chosen).sum(dim=1, keepdim=True) + 1  # 1 + the tokens more likely than it
    parts = [chosen - lse, rank.float()]
    if k > 0:
        vals, ids = x.topk(k, dim=-1)
        parts += [vals - lse, ids.float()]
    return torch.cat(parts, dim=1)


# k varies by batch: unspecialized, so one compiled kernel serves every k (Triton would otherwise
# compile apart k = 1 and k divisible by 16).
@_jit(do_not_specialize=("k",))
def _logprobs_topk_kernel(logits_ptr, token_ptr, tile_stats_ptr, cand_ptr, arrivals_ptr, out_ptr, vocab, stride_row, k,
                          BLOCK: tl.constexpr, TILES: tl.constexpr, KPAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.num_programs(1)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    chosen = tl.load(logits_ptr + row * stride_row + tl.load(token_ptr + row)).to(tl.float32)
    m = tl.max(x)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - tl.where(m > float("-inf"), m, 0.0)), 0.0))
    beats = tl.sum((x > chosen).to(tl.float32))
    stats = tile_stats_ptr + (row * tiles + tile) * 3
    tl.store(stats, m)
    tl.store(stats + 1, s)
    tl.store(stats + 2, beats)

    # The tile's k largest, one at a time; a taken column is never taken again (it matters for a
    # tile with fewer than k finite logits, whose -inf columns then fill the list in order).
    cand = cand_ptr + (row * tiles + tile) * KPAD * 2
    x = tl.where(x != x, float("-inf"), x)
    free = cols < vocab
    for j in range(k):
        top = tl.max(tl.where(free, x, float("-inf")))
        col = tl.min(tl.where(free & (x == top), cols, 2147483647))
        tl.store(cand + j, top)
        tl.store(cand + KPAD + j, col.to(tl.float32))
        free = free & (cols != col)

    # The last program of the row to arrive combines the tiles (the atomic orders their writes).
    if tl.atomic_add(arrivals_ptr + row, 1) == tiles - 1:
        tl.store(arrivals_ptr + row, 0)
        t = tl.arange(0, TILES)
        at = tile_stats_ptr + (row * tiles + t) * 3
        maxes = tl.load(at, mask=t < tiles, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(at + 1, mask=t < tiles, other=0.0, cache_modifier=".cg")
        rank = tl.sum(tl.load(at + 2, mask=t < tiles, other=0.0, cache_modifier=".cg")) + 1.0
        row_max = tl.max(maxes)
        finite = maxes > float("-inf")
        total = tl.sum(tl.where(finite, sums * tl.exp(tl.where(finite, maxes - row_max, 0.0)), 0.0))
        lse = row_max + tl.log(total)
        width = 2 + 2 * k
        tl.store(out_ptr + row * width, chosen - lse)
        tl.store(out_ptr + row * width + 1, rank)

        c = tl.arange(0, KPAD)
        valid = (t[:, None] < tiles) & (c[None, :] < k)  # [TILES, KPAD]: every tile's candidates
        base = cand_ptr + row * tiles * KPAD * 2 + t[:, None] * KPAD * 2 + c[None, :]
        vals = tl.load(base, mask=valid, other=float("-inf"), cache_modifier=".cg")
        ids = tl.load(base + KPAD, mask=valid, other=0.0, cache_modifier=".cg")
        for i in range(k):
            top = tl.max(tl.max(tl.where(valid, vals, float("-inf")), axis=1), axis=0)
            # Ties: the lowest column among the candidates equal to the top (columns are distinct).
            pick = tl.min(tl.min(tl.where(valid & (vals == top), ids, 3.0e38), axis=1), axis=0)
            tl.store(out_ptr + row * width + 2 + i, top - lse)
            tl.store(out_ptr + row * width + 2 + k + i, pick)
            valid = valid & (ids != pick)


def logprobs_topk(logits: torch.Tensor, token_ids: torch.Tensor, k: int, block: int = 4096) -> torch.Tensor:
    """``logprobs_topk_ref``'s rows from one kernel launch, queued without a host sync."""
    if triton is None:
        raise RuntimeError("logprobs_topk: Triton is not installed; use logprobs_topk_ref")
    if logits.dim() != 2:
        raise ValueError(f"logprobs_topk: logits must be [S, V], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not 0 <= k <= MAX_K:
        raise ValueError(f"logprobs_topk: k must be in [0, {MAX_K}], got {k}")
    S, V = logits.shape
    if V >= 2 ** 24:
        raise ValueError(f"logprobs_topk: token ids above 2**24 are not exact in float32 (vocab {V})")
    dev = logits.device
    out = torch.empty(S, 2 + 2 * k, dtype=torch.float32, device=dev)
    if S == 0:
        return out
    # At most 64 tiles, so the combining program holds every tile's candidates at once.
    block = max(block, triton.next_power_of_2(triton.cdiv(V, 64)))
    tiles = triton.cdiv(V, block)
    KPAD = 32
    tile_stats = torch.empty(S, tiles, 3, dtype=torch.float32, device=dev)
    cand = torch.empty(S, tiles, 2, KPAD, dtype=torch.float32, device=dev)
    arrivals = torch.zeros(S, dtype=torch.int32, device=dev)
    _logprobs_topk_kernel[(S, tiles)](logits, token_ids, tile_stats, cand, arrivals, out, V, logits.stride(0), k,
                                      BLOCK=block, TILES=triton.next_power_of_2(tiles), KPAD=KPAD, num_warps=8)
    return out
