"""The KV block pool: reference counts, an LRU free queue and the prefix-cache map.

Invariants (checked by the property tests):
- every block is either referenced (``ref_cnt > 0``) or in the free queue, never both;
- a block in the cache map has a key; a block's key is in the map only while it points back;
- ``num_free_blocks`` counts free blocks whether or not they still hold cached KV: a cached
  free block is reusable as-is by a prefix hit (``touch``) or evicted when allocated.

Free blocks are handed out oldest-freed first, so a cached block that was used recently survives
longest (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # (parent_hash, token_ids) of a full cached block, kept to verify a hash hit.
    key: tuple[int, tuple[int, ...]] | None = None
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block_id

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable prefix-cache KV."""
        return sum(1 for b in self._free if self.blocks[b].block_hash is not None)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block for this hash, verified against its tokens and parent; else None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self.blocks[block_id].key != (parent_hash, token_ids):
            return None  # hash collision: treat as a miss
        return block_id

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # -- the four operations -----------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (evicting any cached KV they hold), each with ref_cnt 1.
        Returns None, taking nothing, when fewer than ``n`` are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self.evict(block_id)
            self.blocks[block_id].ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take another reference to blocks (prefix-cache hits); free ones leave the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in order; blocks reaching zero join the free
        queue's tail (evicted last), keeping their cached KV until then."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def evict(self, block_id: int) -> None:
        """Forget the cached KV of a block (no-op for an uncached block)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.key = None

    # -- prefix cache ------------------------------------------------------------------------

    def cache_block(self, block_id: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> None:
        """Publish a full, referenced block under its chained hash. If another block already
        holds this hash, that one stays canonical and this one remains private."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, "only blocks in use are cached"
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.key = (parent_hash, token_ids)
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Drop all cached KV of free blocks; False if some cached block is still in use."""
        for block_id in list(self._free):
            self.evict(block_id)
        return not self._cached
