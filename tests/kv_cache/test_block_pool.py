"""Unit tests of BlockPool: its four operations (allocate / free / touch / evict), the prefix-cache
map (cache_block / lookup) and the LRU order in which free blocks are handed out."""

from __future__ import annotations

import pytest

from deepbatch.kv_cache.block_pool import BlockPool


def drain_order(pool: BlockPool) -> list[int]:
    """The order the pool would hand out its free blocks (allocates them all; use last)."""
    out = pool.allocate(pool.num_free_blocks)
    assert out is not None
    return out


# -- construction ----------------------------------------------------------------------------


def test_new_pool_is_all_free_and_uncached():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert pool.num_cached_blocks == 0
    assert pool.usage() == 0.0
    assert all(pool.is_free(b) and pool.blocks[b].ref_cnt == 0 for b in range(5))
    # Block ids are their index: the KV tensors are indexed by them.
    assert [b.block_id for b in pool.blocks] == list(range(5))


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_at_least_one_block(n):
    with pytest.raises(ValueError):
        BlockPool(n)


# -- allocate / free -------------------------------------------------------------------------


def test_allocate_hands_out_distinct_referenced_blocks():
    pool = BlockPool(6)
    got = pool.allocate(4)
    assert got is not None and len(got) == 4 and len(set(got)) == 4
    for b in got:
        assert pool.blocks[b].ref_cnt == 1
        assert not pool.is_free(b)
    assert pool.num_free_blocks == 2
    assert pool.usage() == pytest.approx(4 / 6)


def test_allocate_zero_is_an_empty_list_not_none():
    # None means "no room"; asking for nothing must not look like a failure.
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_allocate_more_than_free_returns_none_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.cache_block(held[0], block_hash=11, parent_hash=0, token_ids=(1, 2))
    pool.free([held[0]])  # a cached block now sits in the free queue
    before_ref = [b.ref_cnt for b in pool.blocks]
    before_free = pool.num_free_blocks

    assert pool.allocate(before_free + 1) is None

    assert pool.num_free_blocks == before_free
    assert [b.ref_cnt for b in pool.blocks] == before_ref
    # A refused allocation must not have evicted the cached free block on its way.
    assert pool.lookup(11, 0, (1, 2)) == held[0]
    assert pool.num_cached_blocks == 1


def test_free_returns_a_block_only_when_its_last_reference_drops():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])  # a second owner (a prefix hit)
    assert pool.blocks[b].ref_cnt == 2
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 1 and not pool.is_free(b)
    pool.free([b])
    assert pool.blocks[b].ref_cnt == 0 and pool.is_free(b)
    assert pool.num_free_blocks == 3


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    # The failed free must not have corrupted the accounting.
    assert pool.blocks[b].ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.free([1])
    assert pool.num_free_blocks == 2


# -- LRU order -------------------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order():
    assert drain_order(BlockPool(4)) == [0, 1, 2, 3]


def test_free_blocks_are_reused_oldest_freed_first():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for b in (2, 0, 3, 1):
        pool.free([b])
    assert drain_order(pool) == [2, 0, 3, 1]


def test_free_of_a_list_queues_in_list_order():
    # The manager frees a request's blocks tail first so that its last blocks are evicted first;
    # that relies on free() queueing the given list in order.
    pool = BlockPool(3)
    pool.allocate(3)
    pool.free([1, 2, 0])
    assert drain_order(pool) == [1, 2, 0]


def test_a_block_freed_again_goes_to_the_back_of_the_queue():
    # Recently used cached blocks must survive longest: a block that was free, got hit (touch),
    # and is freed again moves behind blocks that were freed before it.
    pool = BlockPool(3)
    pool.allocate(3)
    pool.free([0])
    pool.free([1])
    pool.free([2])
    pool.touch([0])
    pool.free([0])
    assert drain_order(pool) == [1, 2, 0]


def test_untouched_free_blocks_precede_fresh_ones_that_were_never_used():
    # Initially free blocks are in the queue before anything freed later.
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    assert drain_order(pool) == [1, 2, 3, 0]


# -- touch -----------------------------------------------------------------------------------


def test_touch_of_a_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3)
    pool.touch([1])
    assert pool.blocks[1].ref_cnt == 1
    assert not pool.is_free(1)
    assert pool.num_free_blocks == 2
    assert 1 not in drain_order(pool)


def test_touch_of_a_used_block_only_adds_a_reference():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.touch([b])
    assert pool.blocks[b].ref_cnt == 3
    assert pool.num_free_blocks == 2


# -- prefix cache ----------------------------------------------------------------------------


def test_cache_block_then_lookup_hits():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, block_hash=123, parent_hash=0, token_ids=(5, 6, 7))
    assert pool.lookup(123, 0, (5, 6, 7)) == b
    assert pool.blocks[b].block_hash == 123
    assert pool.blocks[b].key == (0, (5, 6, 7))
    assert pool.num_cached_blocks == 1


def test_lookup_of_an_unknown_hash_misses():
    pool = BlockPool(2)
    assert pool.lookup(42, 0, (1,)) is None


def test_hash_collision_with_different_tokens_is_a_miss():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, block_hash=7, parent_hash=0, token_ids=(1, 2))
    assert pool.lookup(7, 0, (1, 3)) is None


def test_hash_collision_with_a_different_parent_is_a_miss():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, block_hash=7, parent_hash=0, token_ids=(1, 2))
    assert pool.lookup(7, 99, (1, 2)) is None


def test_second_block_with_a_cached_hash_stays_private():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 5, 0, (1,))
    pool.cache_block(b, 5, 0, (1,))
    assert pool.lookup(5, 0, (1,)) == a  # the first stays canonical
    assert pool.blocks[b].block_hash is None and pool.blocks[b].key is None
    assert pool.num_cached_blocks == 1
    # Evicting the private duplicate must not drop the canonical entry.
    pool.free([b])
    pool.evict(b)
    assert pool.lookup(5, 0, (1,)) == a


def test_a_cached_block_is_not_republished_under_another_hash():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, 0, (1,))
    pool.cache_block(a, 6, 0, (2,))
    assert pool.blocks[a].block_hash == 5
    assert pool.lookup(6, 0, (2,)) is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_makes_cache_block_a_no_op():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, 0, (1,))
    assert pool.lookup(5, 0, (1,)) is None
    assert pool.num_cached_blocks == 0
    assert pool.blocks[a].block_hash is None


def test_a_freed_cached_block_keeps_its_kv_and_still_hits():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, 0, (1, 2))
    pool.free([a])
    assert pool.is_free(a)
    assert pool.lookup(5, 0, (1, 2)) == a
    assert pool.num_cached_free_blocks == 1
    # Cached free blocks still count as free: they are reusable capacity.
    assert pool.num_free_blocks == 3


def test_a_cached_free_block_reused_by_lookup_and_touch_leaves_the_free_queue():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, 0, (1, 2))
    pool.free([a])

    hit = pool.lookup(5, 0, (1, 2))
    pool.touch([hit])

    assert pool.blocks[a].ref_cnt == 1 and not pool.is_free(a)
    assert pool.num_free_blocks == 2
    assert pool.num_cached_free_blocks == 0
    # Still cached (a second hit shares it), and never handed out to someone else while held.
    assert pool.lookup(5, 0, (1, 2)) == a
    assert a not in drain_order(pool)
    assert pool.lookup(5, 0, (1, 2)) == a


def test_allocate_evicts_the_cached_kv_of_a_reused_block():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 5, 0, (1, 2))
    pool.free([a])
    assert pool.allocate(1) == [a]
    assert pool.lookup(5, 0, (1, 2)) is None
    assert pool.blocks[a].block_hash is None and pool.blocks[a].key is None
    assert pool.num_cached_blocks == 0


def test_eviction_takes_the_least_recently_freed_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 10, 0, (1,))
    pool.cache_block(b, 20, 0, (2,))
    pool.cache_block(c, 30, 0, (3,))
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(1) == [b]  # freed first, so evicted first
    assert pool.lookup(20, 0, (2,)) is None
    assert pool.lookup(10, 0, (1,)) == a
    assert pool.lookup(30, 0, (3,)) == c


def test_a_hit_refreshes_a_cached_block_against_eviction():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 10, 0, (1,))
    pool.cache_block(b, 20, 0, (2,))
    pool.free([a])
    pool.free([b])
    # a is the oldest free block, but a prefix hit uses it again before anything is allocated.
    pool.touch([pool.lookup(10, 0, (1,))])
    pool.free([a])
    assert pool.allocate(1) == [b]
    assert pool.lookup(10, 0, (1,)) == a


def test_evict_forgets_the_cache_entry_and_is_a_no_op_on_uncached_blocks():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 10, 0, (1,))
    pool.evict(b)  # uncached: nothing to forget
    assert pool.lookup(10, 0, (1,)) == a
    pool.evict(a)
    assert pool.lookup(10, 0, (1,)) is None
    assert pool.blocks[a].block_hash is None and pool.blocks[a].key is None
    # Evicting the KV does not touch the reference count: the block is still in use.
    assert pool.blocks[a].ref_cnt == 1 and not pool.is_free(a)


def test_reset_prefix_cache_drops_free_cached_blocks_but_not_used_ones():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, 10, 0, (1,))
    pool.cache_block(b, 20, 0, (2,))
    pool.free([a])
    assert pool.reset_prefix_cache() is False  # b is still in use
    assert pool.lookup(10, 0, (1,)) is None
    assert pool.lookup(20, 0, (2,)) == b
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 3
