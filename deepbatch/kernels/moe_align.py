"""Sorting a MoE batch's (token, expert) pairs by expert for the grouped GEMM, in one launch.

Same output as :func:`sort_pairs_by_expert` (its torch reference, below):
``sorted_ids`` lists pair indices ``t*K + k`` grouped by expert in increasing order, each group
padded with ``T*K`` to a multiple of ``block_m``; ``expert_ids`` names each tile's expert;
``num_padded`` is the used length. The torch version is about fifteen small kernels (a radix sort,
scans, a search, scatters): ~150 us per MoE layer on an H200 at a decode batch, most of a
millisecond per step at 26 MoE layers. This kernel is one program that walks the pairs in chunks:

    counts[e]            one-hot [CHUNK, E] column sums, accumulated over chunks
    start[e]             exclusive prefix sum of counts rounded up to block_m
    dest(pair)           start[e] + (pairs of e before it): a column cumsum of the one-hot plus a
                         running cursor per expert, so the order inside an expert is the pairs' own

One program serialises the walk, so it pays off for decode-sized batches; large batches keep the
torch sort (:data:`MAX_PAIRS`).
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, tl, triton

MAX_PAIRS = 16384  # above this the torch sort's parallelism wins over one program's walk


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``(sorted_ids, expert_ids, num_padded)`` for the kernel (module docstring). ``sorted_ids``
    lists pair indices ``t*K + k`` grouped by expert, each group padded with ``T*K`` to a multiple
    of ``block_m``; ``expert_ids`` names the expert of each ``block_m`` tile; ``num_padded`` is the
    used length (a one-element tensor). Tiles past it are never read."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount sizes its output from the data (a device sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # The pair's rank inside its expert's run, moved from the unpadded to the padded layout.
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    # Only experts that got a pair are padded: at most min(E, T*K) runs of block_m - 1.
    capacity = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@_jit(do_not_specialize=("num_pairs", "capacity"))
def _moe_align_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, capacity,
    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(num_padded_ptr, tl.sum(padded, 0))

    # Padding everywhere first; the pairs overwrite their slots below (after the barrier).
    for start in range(0, capacity, CHUNK):
        pos = start + offs
        tl.store(sorted_ids_ptr + pos, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=pos < capacity)
    # A tile's expert: how many experts' runs end at or before its first row (tiles past the
    # last run name the last expert, as the reference's clamp does; they are never read).
    num_tiles = capacity // BLOCK_M
    for t0 in range(0, num_tiles, CHUNK):
        tiles = t0 + offs
        e = tl.sum((ends[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(expert_ids_ptr + tiles, tl.minimum(e, NUM_EXPERTS - 1), mask=tiles < num_tiles)
    tl.debug_barrier()

    cursor = ends - padded
    for start in range(0, num_pairs, CHUNK):
        pos = start + offs
        valid = pos < num_pairs
        ids = tl.load(ids_ptr + pos, mask=valid, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same expert in this chunk
        dest = tl.sum(onehot * (before + cursor[None, :]), 1)
        tl.store(sorted_ids_ptr + dest, pos.to(tl.int32), mask=valid)
        cursor += tl.sum(onehot, 0)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, chunk: int | None = None,
              num_warps: int = 4):
    """``(sorted_ids, expert_ids, num_padded)`` exactly as :func:`sort_pairs_by_expert` returns
    them; one Triton launch for up to :data:`MAX_PAIRS` pairs, the torch sort above that (or
    without Triton). Sized by host ints only: capturable in a CUDA graph. ``chunk`` (pairs per
    iteration, a power of two) and ``num_warps`` override the launch (benchmarks/moe_sweep.py)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be an int32/int64 [T, K], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: need num_experts >= 1 and block_m a power of two, got {num_experts}, {block_m}")
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    if triton is None or num_pairs == 0 or num_pairs > MAX_PAIRS:
        return sort_pairs_by_expert(topk_ids, num_experts, block_m)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    capacity = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_e = triton.next_power_of_2(num_experts)
    if chunk is None:  # the one-hot tile is CHUNK x BLOCK_E: about 8k elements keeps it in registers
        chunk = max(16, 8192 // block_e)
    # 4 warps: the walk is serial, so fewer threads synchronise faster. At 64 experts on an H200,
    # 30 / 34 / 120 us for 64 / 256 / 1,024 tokens x top-6 against 38 / 43 / 158 us with 8 warps
    # (benchmarks/moe_sweep.py --align-only).
    _moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, num_padded, num_pairs, capacity,
        NUM_EXPERTS=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk, num_warps=num_warps,
    )
    return sorted_ids, expert_ids, num_padded
