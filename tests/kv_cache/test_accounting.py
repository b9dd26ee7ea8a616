"""KV accounting on crafted block states."""

from __future__ import annotations

import pytest

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager


def running_request(kv, rid, tokens, computed):
    r = Request(rid, list(tokens), SamplingParams(max_tokens=4), 4)
    hits, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, computed - n_hit, hits) is not None
    r.num_computed_tokens = computed
    return r


def test_fragmentation_and_token_usage_of_one_request():
    kv = KVCacheManager(10, 16)
    r = running_request(kv, "a", range(100, 120), 20)  # 20 tokens: one full block + 4
    st = kv.stats([r])
    assert (st.used_blocks, st.free_blocks, st.used_slots_with_tokens) == (2, 8, 20)
    assert st.internal_fragmentation == pytest.approx(12 / 32)
    assert st.token_usage == pytest.approx(20 / 160)
    assert st.usage == pytest.approx(2 / 10)


def test_shared_prefix_blocks_are_counted_once():
    kv = KVCacheManager(10, 16)
    prefix = list(range(100, 132))  # two full blocks
    a = running_request(kv, "a", prefix + [1, 2, 3], 35)
    b = running_request(kv, "b", prefix + [4, 5], 34)
    st = kv.stats([a, b])
    assert st.used_blocks == 4  # 2 shared + a's tail + b's tail
    assert st.used_slots_with_tokens == 32 + 3 + 2
    assert st.internal_fragmentation == pytest.approx((64 - 37) / 64)


def test_blocks_held_only_by_the_prefix_cache():
    kv = KVCacheManager(10, 16)
    a = running_request(kv, "a", range(100, 140), 40)
    kv.free(a)
    st = kv.stats([])
    assert st.used_blocks == 0 and st.free_blocks == 10
    assert st.cached_free_blocks == 2  # the two full blocks stay reusable
    assert st.token_usage == pytest.approx(32 / 160)
    assert st.internal_fragmentation == 0.0


def test_tokens_in_use_match_a_block_by_block_count():
    """Random requests (shared prefixes, partial last blocks, blocks allocated ahead of their
    tokens): the tokens held equal a walk over every block of every request, each block counted
    once at its fullest."""
    import random

    rng = random.Random(0)
    bs = 8
    kv = KVCacheManager(400, bs)
    prefixes = [[rng.randrange(1000) for _ in range(bs * rng.randrange(1, 4))] for _ in range(3)]
    running = []
    for i in range(20):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        r = running_request(kv, str(i), tokens, len(tokens))
        r.num_computed_tokens = rng.randrange(0, len(tokens) + 1)  # some not yet written
        running.append(r)
    fill: dict[int, int] = {}
    for r in running:
        for i, b in enumerate(r.block_ids):
            fill[b] = max(fill.get(b, 0), min(bs, max(0, r.num_computed_tokens - i * bs)))
    st = kv.stats(running)
    assert st.used_slots_with_tokens == sum(fill.values())
    assert any(r.num_computed_tokens % bs for r in running) and len(fill) < sum(len(r.block_ids) for r in running)
