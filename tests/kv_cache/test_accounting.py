"""KV accounting on crafted block states."""

from __future__ import annotations

import pytest

from deepbatch.engine.request import Request
from deepbatch.engine.sampling_params import SamplingParams
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
