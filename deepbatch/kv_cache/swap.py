"""Preemption by swapping: the host (CPU) block pool and the cost model that picks swap or
recompute for each victim.

When the device KV cache runs out, a running request is preempted. Its KV can either be dropped
and recomputed later (a prefill over all its tokens) or copied to a pinned host pool now and
copied back when it resumes (two trips over the host link). Which is cheaper depends on the model
and the machine::

    recompute_s = num_computed_tokens / prefill_tokens_per_s
    swap_s      = 2 * num_blocks * kv_bytes_per_block / host_link_bytes_per_s   (out + in)

Per token, swap costs ``2 * kv_bytes_per_token / link`` and recompute ``1 / prefill``, so the
choice is the same for every victim of one engine except at the edges (a victim with no computed
tokens is free to recompute; one that shares blocks, or does not fit the host pool, must
recompute). The rates are measured at start-up unless configured.

The host pool mirrors the device pool's block layout: one slot holds one block of every layer's
cache tensors. This module only does the bookkeeping (which slots are free); the model runner
owns the tensors and performs the copies the scheduler output lists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapCostModel:
    """Seconds to recompute ``n`` tokens vs seconds to move ``b`` blocks out and back in.

    Contract: ``prefer_swap(num_tokens, num_blocks)`` is True only when swapping those blocks is
    strictly cheaper than recomputing those tokens; it never looks at capacity or sharing (the
    scheduler checks those)."""

    prefill_tokens_per_s: float
    host_link_bytes_per_s: float
    kv_bytes_per_block: int

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.host_link_bytes_per_s <= 0 or self.kv_bytes_per_block <= 0:
            raise ValueError(f"swap cost model: rates and block size must be > 0, got {self}")

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_blocks: int) -> float:
        # Out now and in later: the same bytes cross the link twice.
        return 2 * num_blocks * self.kv_bytes_per_block / self.host_link_bytes_per_s

    def prefer_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)


class HostBlockPool:
    """Free-slot bookkeeping of the host swap pool (slots ``0 .. num_blocks-1``).

    Invariant: a slot is either free or held by exactly one swapped-out request. ``allocate``
    takes all or nothing."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"host pool: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Lowest slots first: keeps the touched part of the pinned pool small and warm.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        # Reversed so that the lowest slot is handed out first again.
        self._free.extend(sorted(slots, reverse=True))
        if len(self._free) > self.num_blocks:
            raise RuntimeError("host pool: a slot was freed twice")


def num_host_blocks(swap_space_bytes: int, kv_bytes_per_block: int) -> int:
    """How many blocks a swap space of this many bytes holds."""
    return int(swap_space_bytes // kv_bytes_per_block) if kv_bytes_per_block > 0 else 0
