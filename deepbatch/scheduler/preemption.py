"""How a running request gives up its KV blocks, and how a swapped one gets them back.

The scheduler decides *whom* to preempt (the running request that sorts last); this module
decides *how*:

- **recompute**: free the blocks; the request later runs a prefill over all its tokens (prefix
  hits may shorten it);
- **swap**: list ``device block -> host slot`` copies in the step's output, free the blocks;
  when the request is at the head of the waiting queue again, allocate fresh device blocks, list
  ``host slot -> device block`` copies, and it continues where it stopped.

A victim is swapped only when (1) a host pool exists, (2) it has computed tokens, (3) it owns every
one of its blocks alone (a block shared through the prefix cache with a running request is not
freed by the preemption, so copying it would cost link time and gain no room), (4) the host pool
has the slots, and (5) the cost model says swapping is cheaper (``preemption_mode="auto"``, the
default; ``"swap"`` skips this test and ``"recompute"`` never swaps). Otherwise it is recomputed.

Either way the request leaves the running set with no device blocks and ``num_computed_tokens ==
0``; a swapped one's computed count waits here until it is swapped in.

Under a sliding window (``KVCacheManager.sliding_window``) only the blocks its next step reads
travel: blocks ``first_needed_block(num_computed) .. blocks_needed(num_computed) - 1``, and the
swap-in gets device blocks for those positions on. Host slots freed by a
swap-in are returned at the start of the next step, so no swap-out of the same step can overwrite
a slot before the runner has read it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepbatch.core.request import Request
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.kv_cache.swap import HostBlockPool, SwapCostModel

SWAP = "swap"
RECOMPUTE = "recompute"


@dataclass
class _Swapped:
    slots: list[int]  # host slot of each of the request's blocks from ``first_block`` on, in order
    num_computed_tokens: int
    first_block: int = 0  # > 0 only under a sliding window


class Preemptor:
    """Preemption by swap or recompute, with per-mode counts.

    Contract: ``preempt`` always succeeds (it falls back to recompute) and appends any copies to
    the given lists; ``swap_in`` allocates device blocks for the saved tokens plus
    ``num_new_tokens`` or, when the pool cannot supply them, changes nothing and returns False."""

    def __init__(self, kv_cache: KVCacheManager, host_pool: HostBlockPool | None = None,
                 cost_model: SwapCostModel | None = None, mode: str = "auto"):
        if (host_pool is None) != (cost_model is None):
            raise ValueError("swap needs both a host pool and a cost model")
        self.kv_cache = kv_cache
        self.mode = mode  # "auto": the cost model decides; "swap" / "recompute": forced
        self.host_pool = host_pool
        self.cost_model = cost_model
        self._swapped: dict[str, _Swapped] = {}
        self._release: list[int] = []  # host slots read back this step; free from the next one
        self.num_preemptions_by_mode = {SWAP: 0, RECOMPUTE: 0}

    @property
    def swap_enabled(self) -> bool:
        return self.host_pool is not None and self.host_pool.num_blocks > 0

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def begin_step(self) -> None:
        if self._release:
            self.host_pool.free(self._release)
            self._release = []

    def _blocks_to_save(self, request: Request) -> tuple[int, int]:
        """``(first, end)``: the block positions holding the KV the request's next step reads."""
        kv = self.kv_cache
        return kv.first_needed_block(request.num_computed_tokens), kv.blocks_needed(request.num_computed_tokens)

    def choose(self, request: Request) -> str:
        """The mode ``preempt`` would use for this request now."""
        if not self.swap_enabled or self.mode == RECOMPUTE or request.num_computed_tokens == 0:
            return RECOMPUTE
        first, end = self._blocks_to_save(request)
        num_blocks = end - first
        if num_blocks > self.host_pool.num_free_blocks:
            return RECOMPUTE
        blocks = self.kv_cache.pool.blocks
        if any(blocks[b].ref_cnt > 1 for b in self.kv_cache.held_block_ids(request)):
            return RECOMPUTE
        if self.mode == SWAP:
            return SWAP
        return SWAP if self.cost_model.prefer_swap(request.num_computed_tokens, num_blocks) else RECOMPUTE

    def preempt(self, request: Request, swap_out: list[tuple[int, int]]) -> str:
        """Take the request's device blocks away; returns the mode used."""
        mode = self.choose(request)
        if mode == SWAP:
            first, end = self._blocks_to_save(request)
            slots = self.host_pool.allocate(end - first)
            swap_out.extend(zip(request.block_ids[first:end], slots))
            self._swapped[request.request_id] = _Swapped(slots, request.num_computed_tokens, first)
        # Freed blocks may be handed to another request in this same step; the runner copies
        # them out before the forward that could overwrite them.
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        self.num_preemptions_by_mode[mode] += 1
        return mode

    def swapped_tokens(self, request: Request) -> int:
        """Computed tokens waiting in the host pool for this request (0: not swapped)."""
        rec = self._swapped.get(request.request_id)
        return rec.num_computed_tokens if rec is not None else 0

    def swap_in(self, request: Request, num_new_tokens: int, swap_in: list[tuple[int, int]]) -> bool:
        rec = self._swapped[request.request_id]
        assert request.num_computed_tokens == 0 and not request.block_ids
        # Allocated as a request that has computed its saved tokens, so that under a window the
        # blocks before the saved ones are not allocated at all.
        request.num_computed_tokens = rec.num_computed_tokens
        if self.kv_cache.allocate_slots(request, num_new_tokens) is None:
            request.num_computed_tokens = 0
            return False
        swap_in.extend(zip(rec.slots, request.block_ids[rec.first_block:rec.first_block + len(rec.slots)]))
        self._release.extend(rec.slots)
        del self._swapped[request.request_id]
        return True

    def forget(self, request: Request) -> None:
        """The request ended (finished, aborted, failed) while swapped out: drop its slots."""
        rec = self._swapped.pop(request.request_id, None)
        if rec is not None:
            self.host_pool.free(rec.slots)
