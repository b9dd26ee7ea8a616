"""The scheduler's only view of the KV cache: ``get_computed_blocks / allocate_slots / free``.

A request's blocks cover its tokens in order; token ``i`` lives in slot
``block_ids[i // block_size] * block_size + i % block_size``::

    block_ids:   [ b7        | b2        | b9  ...   ]
    tokens:      [0 .. bs-1  | bs..2bs-1 | 2bs ..    ]
                  ^ full blocks are hashed (chained) and may be shared through the prefix cache

``allocate_slots`` returning None means "no room": the scheduler decides whom to preempt.

With a sliding window ``W`` on every attention layer (``sliding_window``), a step whose first
new token is at position ``c`` reads no key before ``c - W + 1``, so the blocks wholly before it
go back to the pool as the sequence grows. Their entries become ``NULL_BLOCK`` and stay in
place, so block ``i`` still covers tokens ``i*bs ..``; released entries are always a prefix::

    block_ids:   [ -1  | -1  | b9  | b4  | b6 ]        first needed block = (c - W + 1) // bs
    keys read:                [ c-W+1 ...  c+n-1 ]

A sequence then holds about ``(W + chunk) / bs + 1`` blocks however long it grows. A model that
mixes windowed and full-attention layers passes no window here: its full layers need every
block (all layers share one block table).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import xxhash

from deepbatch.core.request import Request
from deepbatch.kv_cache.block_pool import BlockPool

_ROOT_HASH = 0
# A ``block_ids`` entry whose block slid out of the window and went back to the pool. Attention
# never reads it (``kernels/paged_attention.py``); the manager never frees it again.
NULL_BLOCK = -1


@dataclass(frozen=True)
class KVCacheStats:
    """Where the KV slots are. ``usage`` is vLLM's meaning (blocks not free / all blocks);
    ``token_usage`` counts slots that hold a token (running requests' KV, deduplicated across
    shared prefix blocks, plus full blocks kept only by the prefix cache); internal
    fragmentation is the share of allocated slots that hold no token (the unfilled tails of
    each request's last block)."""

    num_blocks: int
    block_size: int
    free_blocks: int
    cached_free_blocks: int  # free, but still holding prefix-cache KV
    used_blocks: int  # referenced by running requests
    used_slots_with_tokens: int
    usage: float
    token_usage: float
    internal_fragmentation: float


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    h = xxhash.xxh3_64(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        # request_id -> number of the request's leading blocks already published to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # request_id -> number of its leading entries that are NULL_BLOCK (slid out of the window).
        self._num_released: dict[str, int] = {}
        # Prefix-cache statistics, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> float:
        return self.pool.usage()

    def stats(self, running: list[Request]) -> KVCacheStats:
        """Accounting over the running requests' blocks (O(their blocks), in set operations:
        cheap enough for metrics and sampled benchmarks, still not for every step).

        A block holds ``min(bs, tokens past its start)`` tokens of a request that has it; a block
        shared by several (a prefix hit) counts once, at its fullest."""
        bs = self.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}  # blocks with some but not all of their slots written
        for r in running:
            n = r.num_computed_tokens
            k, rest = divmod(n, bs)
            full.update(r.block_ids[self._num_released.get(r.request_id, 0):k])
            if rest and k < len(r.block_ids):
                b = r.block_ids[k]
                partial[b] = max(partial.get(b, 0), rest)
        cached_free = self.pool.num_cached_free_blocks
        used_blocks = self.pool.num_blocks - self.pool.num_free_blocks
        tokens_in_used = len(full) * bs + sum(v for b, v in partial.items() if b not in full)
        allocated_slots = used_blocks * bs
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            block_size=bs,
            free_blocks=self.pool.num_free_blocks,
            cached_free_blocks=cached_free,
            used_blocks=used_blocks,
            used_slots_with_tokens=tokens_in_used,
            usage=self.pool.usage(),
            token_usage=(tokens_in_used + cached_free * bs) / (self.pool.num_blocks * bs),
            internal_fragmentation=(allocated_slots - tokens_in_used) / allocated_slots if allocated_slots else 0.0,
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block a step that starts at token ``num_computed_tokens`` reads (0 without
        a window): the earlier ones hold only keys outside every new token's window."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int) -> int:
        """Blocks a request holds while it decodes its ``num_tokens``-th token (a prefill chunk
        of ``n`` tokens holds up to ``(n - 1) / bs + 1`` more for the step)."""
        return self.blocks_needed(num_tokens) - self.first_needed_block(max(num_tokens - 1, 0))

    def blocks_to_fit(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once when no step gives it
        more than ``max_chunk`` tokens: all of them without a window; with one, a step's keys
        (``window - 1 + chunk`` tokens, starting anywhere in a block)."""
        whole = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return whole
        span = self.sliding_window - 1 + min(max_chunk, num_tokens) + self.block_size - 1
        return min(whole, self.blocks_needed(span))

    def held_block_ids(self, request: Request) -> list[int]:
        """The request's blocks still in its hands, in order (released ones left out)."""
        return request.block_ids[self._num_released.get(request.request_id, 0):]

    def num_held_blocks(self, request: Request) -> int:
        return len(request.block_ids) - self._num_released.get(request.request_id, 0)

    # -- hashing -----------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        known = request.num_known_tokens  # a pending token's id is not known yet
        while (len(hashes) + 1) * bs <= known:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs])))

    # -- interface ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Leading full blocks of the request already in the prefix cache, and how many tokens
        they hold. The last token is never a hit: its logits must be computed. Nor is a prompt
        position whose prompt logprob the request still needs (none is recorded before its
        first run; all of them after it, for a rerun after preemption): a hit has no logits.
        The request's own blocks are still published for others."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.prompt_logprobs is not None:
            # Positions [0, len - 1) are recorded; a hit must end at or before the first that is not.
            max_blocks = min(max_blocks, (len(request.prompt_logprobs) - 1) // self.block_size)
        hits: list[int] = []
        parent = _ROOT_HASH
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.lookup(block_hash, parent, tokens)
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_hash
        return hits, len(hits) * bs

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup (a lookup retried while the request waits
        for room is counted once, when it is admitted)."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones (and
        after ``computed_blocks``, prefix hits being attached now). Returns the newly allocated
        block ids, or None, changing nothing, when the pool cannot supply them.

        With a window, blocks before the first one this step reads are released first (and
        count as room), hits before it are not attached, and a request that has computed
        tokens but no blocks (resuming from swap) gets blocks from that first one on only."""
        if not computed_blocks:
            # Fast path (every decode step): the last block still has room.
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(request.block_ids) * self.block_size:
                if self.sliding_window is not None:
                    self._release_out_of_window(request, self.first_needed_block(request.num_computed_tokens))
                self._cache_full_blocks(request, end)
                return []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        first = self.first_needed_block(num_computed)
        have = len(request.block_ids)
        # Positions [have, have + len(hits)) take the hits, then new blocks up to the end; any
        # of them before ``first`` stay NULL_BLOCK.
        skipped_hits = min(max(first - have, 0), len(computed_blocks))
        hits = computed_blocks[skipped_hits:]
        new_start = have + len(computed_blocks)
        skipped_new = max(first - new_start, 0)
        need = max(self.blocks_needed(num_computed + num_new_tokens) - new_start - skipped_new, 0)
        # Hit blocks sitting in the free queue stop being free once touched; blocks released
        # now join it.
        reclaimed = sum(1 for b in hits if self.pool.is_free(b))
        released = sum(1 for b in self._out_of_window(request, first) if self.pool.blocks[b].ref_cnt == 1)
        if need > self.pool.num_free_blocks - reclaimed + released:
            return None
        self._release_out_of_window(request, first)
        if computed_blocks:
            self.pool.touch(hits)
            request.block_ids.extend([NULL_BLOCK] * skipped_hits + hits)
            self._num_cached_blocks[request.request_id] = len(request.block_ids)
        new_blocks = self.pool.allocate(need) or []
        request.block_ids.extend([NULL_BLOCK] * skipped_new + new_blocks)
        if skipped_hits or skipped_new:
            self._num_released[request.request_id] = min(first, len(request.block_ids))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so that its last blocks are evicted first."""
        self.pool.free(list(reversed(self.held_block_ids(request))))
        request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)

    # -- internals ---------------------------------------------------------------------------

    def _out_of_window(self, request: Request, first: int) -> list[int]:
        """The request's held blocks before block ``first``."""
        start = self._num_released.get(request.request_id, 0)
        return request.block_ids[start:min(first, len(request.block_ids))]

    def _release_out_of_window(self, request: Request, first: int) -> None:
        """Give back the request's blocks before block ``first``, which no step from now on
        reads. A step already launched may still read them: it runs before any later step
        that could write them (one stream; a tensor-parallel worker runs steps in order)."""
        blocks = self._out_of_window(request, first)
        if not blocks:
            return
        start = self._num_released.get(request.request_id, 0)
        self.pool.free(blocks)
        request.block_ids[start:start + len(blocks)] = [NULL_BLOCK] * len(blocks)
        self._num_released[request.request_id] = start + len(blocks)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that will be full once ``num_tokens`` are computed.
        Their tokens are known now (prompt, or tokens sampled earlier), so their hashes are too."""
        if not self.enable_caching:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens, request.num_known_tokens) // self.block_size
        if end <= start:
            return
        self._update_block_hashes(request)
        bs = self.block_size
        for i in range(start, end):
            if request.block_ids[i] == NULL_BLOCK:
                continue  # released before it was published (a hit past the window, a swap-in)
            parent = request.block_hashes[i - 1] if i > 0 else _ROOT_HASH
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i], parent, tokens)
        self._num_cached_blocks[request.request_id] = end
