"""The router's prefix picture and choice, without Ray: hashes as the engine's prefix cache makes
them, the longest match wins, load beyond the margin overrides it, capacity bounds the picture."""

from __future__ import annotations

import random

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.serve_ray.prefix_index import PrefixIndex, block_hashes


def engine_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """What the engine's prefix cache computes for a request with these tokens."""
    manager = KVCacheManager(num_blocks=64, block_size=block_size)
    request = Request("r", token_ids, SamplingParams(max_tokens=1), max_tokens=1)
    manager.get_computed_blocks(request)
    return list(request.block_hashes)


def test_block_hashes_are_the_engines():
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(16 * 5 + 7)]
    for block_size in (1, 16, 32):
        assert block_hashes(tokens, block_size) == engine_hashes(tokens, block_size)[:len(tokens) // block_size]
    assert len(block_hashes(tokens, 16)) == 5
    assert block_hashes(tokens[:15], 16) == []


def test_longest_prefix_wins_and_is_recorded():
    index = PrefixIndex(imbalance_margin=4, rng=random.Random(1))
    shared = list(range(64))
    a, b = block_hashes(shared + [1] * 16, 16), block_hashes(shared[:32] + [2] * 48, 16)
    index.record("A", a)
    index.record("B", b)
    loads = {"A": 0, "B": 0}
    assert index.rank(["A", "B"], block_hashes(shared + [9] * 20, 16), loads) == [["A"], ["B"]]
    assert index.rank(["B", "A"], b, loads) == [["B"], ["A"]]
    assert index.match("A", a) == 5 and index.match("B", a) == 2


def test_busy_holder_gives_way_beyond_the_margin():
    index = PrefixIndex(imbalance_margin=2, rng=random.Random(2))
    prompt = block_hashes(list(range(48)), 16)
    index.record("A", prompt)
    assert index.rank(["A", "B"], prompt, {"A": 3, "B": 1})[0] == ["A"]  # 2 more: within the margin
    assert index.rank(["A", "B"], prompt, {"A": 4, "B": 1}) == [["B"], ["A"]]  # 3 more: load decides
    assert index.rank(["A", "B"], prompt, {"A": None, "B": 5})[0] == ["A"]  # unknown load: keep affinity


def test_new_prefixes_spread_and_uniform_load_balances():
    index = PrefixIndex(imbalance_margin=8, rng=random.Random(3))
    counts = {"A": 0, "B": 0}
    rng = random.Random(4)
    for i in range(200):  # distinct prompts, sent one after another (equal loads)
        prompt = block_hashes([rng.randrange(50_000) for _ in range(64)], 16)
        chosen = index.rank(["A", "B"], prompt, {"A": 0, "B": 0})[0][0]
        index.record(chosen, prompt)
        counts[chosen] += 1
    assert counts["A"] == counts["B"] == 100  # the one holding fewer blocks takes the next prompt


def test_a_new_prefix_goes_to_the_emptier_cache_unless_load_differs_by_more_than_the_margin():
    index = PrefixIndex(imbalance_margin=2, rng=random.Random(7))
    index.record("A", block_hashes(list(range(160)), 16))
    new = block_hashes(list(range(500, 548)), 16)
    assert index.rank(["A", "B"], new, {"A": 0, "B": 2}) == [["B"], ["A"]]  # busier by 2: cache balance wins
    assert index.rank(["A", "B"], new, {"A": 0, "B": 3}) == [["A"], ["B"]]  # by 3: load wins


def test_session_sticks_without_a_prefix_match():
    index = PrefixIndex(rng=random.Random(5))
    index.record("B", block_hashes(list(range(32)), 16), tenant="alice")
    other = block_hashes(list(range(100, 132)), 16)
    assert index.rank(["A", "B"], other, {"A": 0, "B": 0}, tenant="alice")[0] == ["B"]
    assert PrefixIndex(session_affinity=False).rank(["A"], other, {"A": 0}, tenant="alice") == [["A"]]


def test_capacity_bounds_the_picture_lru_first():
    index = PrefixIndex(rng=random.Random(6))
    index.set_capacity("A", 4)
    old, new = block_hashes(list(range(48)), 16), block_hashes(list(range(1000, 1048)), 16)
    index.record("A", old)
    index.record("A", new)  # 6 blocks into 4: the oldest three minus one go
    assert index.num_blocks("A") == 4
    assert index.match("A", new) == 3 and index.match("A", old) == 0
    index.retain(["B"])
    assert index.num_blocks("A") == 0
