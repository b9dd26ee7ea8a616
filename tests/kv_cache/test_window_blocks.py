"""KV blocks that follow a sliding window: a sequence gives back the blocks wholly before its
window as it grows, holds about ``(window + chunk) / block_size + 1`` blocks however long it
gets, and still reads its own tokens over the window through prefix hits, preemption by
recompute and by swap.

A fake runner drives the real scheduler: an "echo" cache (slot -> token id) takes each scheduled
token's id where the model would write its K/V, and each step every scheduled query position
reads back the keys of its window (``p - W < k <= p``) only; nothing outside a window is read,
as the attention kernels promise."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import NULL_BLOCK, KVCacheManager
from deepbatch.kv_cache.swap import HostBlockPool, SwapCostModel
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP, Preemptor
from deepbatch.scheduler.scheduler import Scheduler
from tests.scheduler.commit import commit_step

FILLER = 7
SWAP_WINS = dict(prefill_tokens_per_s=1e3, host_link_bytes_per_s=1e12, kv_bytes_per_block=1024)


def make_request(rid, prompt, max_tokens=4, arrival=0.0, priority=0):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens, arrival_time=arrival,
                   priority=priority)


def prompt_of(n, start=100):
    return list(range(start, start + n))


def make_scheduler(num_blocks, block_size, window, budget=64, max_num_seqs=8, caching=True, host_blocks=0,
                   admission="greedy", policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, sliding_window=window)
    preemptor = Preemptor(kv, HostBlockPool(host_blocks), SwapCostModel(**SWAP_WINS), "swap") if host_blocks \
        else Preemptor(kv)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, priority_aging_s=0,
                          admission=admission, policy=policy)
    return Scheduler(cfg, kv, 4096, preemptor=preemptor)


def held_bound(window, chunk, bs):
    """Blocks a step of ``chunk`` tokens may need: its keys span ``window - 1 + chunk`` tokens,
    which start anywhere in a block."""
    return -(-(window - 1 + chunk + bs - 1) // bs)


class WindowRunner:
    """Drives a Scheduler the way the engine does, checking the window's contract every step."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv = sched.kv_cache
        self.window = self.kv.sliding_window
        self.bs = self.kv.block_size
        self.cache: dict[int, int] = {}
        self.host: dict[int, list] = {}
        self.num_steps = 0
        self.max_held = 0

    def slot(self, r, pos):
        block = r.block_ids[pos // self.bs]
        assert block != NULL_BLOCK, f"{r.request_id}: position {pos} is in a released block"
        return block * self.bs + pos % self.bs

    def step(self):
        sched = self.sched
        out = sched.schedule()
        self.num_steps += 1
        for block, slot in out.blocks_to_swap_out:
            self.host[slot] = [self.cache.get(block * self.bs + i) for i in range(self.bs)]
        for slot, block in out.blocks_to_swap_in:
            for i, token in enumerate(self.host.pop(slot)):
                self.cache[block * self.bs + i] = token
        self.check_accounting()
        for s in out.scheduled:
            r, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            held = self.kv.num_held_blocks(r)
            assert held <= held_bound(self.window, n, self.bs), (r.request_id, c, n, r.block_ids)
            self.max_held = max(self.max_held, held)
            # Released entries are a prefix, and exactly the blocks before the step's window.
            first = max(0, c - self.window + 1) // self.bs
            assert all(b == NULL_BLOCK for b in r.block_ids[:first])
            assert NULL_BLOCK not in r.block_ids[first:]
            for pos in range(c, c + n):
                self.cache[self.slot(r, pos)] = r.all_token_ids[pos]
        for s in out.scheduled:
            r, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            for p in range(c, c + n):
                keys = range(max(0, p - self.window + 1), p + 1)
                got = [self.cache.get(self.slot(r, k)) for k in keys]
                assert got == r.all_token_ids[keys.start:p + 1], f"{r.request_id} reads someone else's KV"
        sampled = {s.request.request_id: FILLER for s in out.scheduled if s.samples}
        commit_step(sched, out, sampled)
        self.check_accounting()
        return out

    def check_accounting(self):
        pool = self.kv.pool
        owners = Counter(b for r in self.sched.running for b in self.kv.held_block_ids(r))
        assert NULL_BLOCK not in owners
        for b in pool.blocks:
            assert b.ref_cnt == owners[b.block_id], f"block {b.block_id} leaked or double-owned"
            assert (b.ref_cnt > 0) != pool.is_free(b.block_id)

    def run(self, max_steps=3000):
        while self.sched.has_unfinished():
            assert self.num_steps < max_steps, "no progress"
            self.step()
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks
        assert self.host == {}


def test_a_long_decode_holds_a_window_of_blocks():
    # 200 tokens in blocks of 4 would take 50 blocks; the window of 16 keeps it at 5 or 6.
    sched = make_scheduler(num_blocks=8, block_size=4, window=16, budget=8)
    r = make_request("a", prompt_of(40), max_tokens=160)
    sched.add_request(r)
    runner = WindowRunner(sched)
    runner.run()
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [FILLER] * 160
    assert runner.max_held <= held_bound(16, 8, 4) == 7
    assert sched.num_preemptions == 0


def test_without_a_window_the_same_request_never_fits():
    sched = make_scheduler(num_blocks=8, block_size=4, window=None, budget=8)
    r = make_request("a", prompt_of(40), max_tokens=160)
    sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        commit_step(sched, out, {s.request.request_id: FILLER for s in out.scheduled if s.samples})
    assert r.status == RequestStatus.FINISHED_ERROR


def test_released_blocks_are_the_ones_before_the_window_of_the_first_new_token():
    kv = KVCacheManager(20, 4, sliding_window=6)
    r = make_request("a", prompt_of(30), max_tokens=2)
    assert kv.allocate_slots(r, 10) is not None  # tokens 0..9: nothing to release yet
    assert r.block_ids.count(NULL_BLOCK) == 0 and len(r.block_ids) == 3
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 10) is not None  # queries 10..19 see keys from 5 on: block 0 goes
    assert r.block_ids[0] == NULL_BLOCK and NULL_BLOCK not in r.block_ids[1:] and len(r.block_ids) == 5
    assert kv.pool.num_free_blocks == 20 - 4 and kv.num_held_blocks(r) == 4
    r.num_computed_tokens = 20
    assert kv.allocate_slots(r, 1) is not None  # key 15 on: blocks 0..2 released
    assert r.block_ids[:3] == [NULL_BLOCK] * 3 and kv.num_held_blocks(r) == 3
    stats = kv.stats([r])
    assert stats.used_blocks == 3 and stats.used_slots_with_tokens == 8  # blocks 3, 4 full
    kv.free(r)
    assert kv.pool.num_free_blocks == 20 and r.block_ids == []


def test_released_blocks_count_as_room_and_a_refusal_changes_nothing():
    kv = KVCacheManager(5, 4, sliding_window=4)
    r = make_request("a", prompt_of(40), max_tokens=2)
    assert kv.allocate_slots(r, 20) is not None  # all 5 blocks
    r.num_computed_tokens = 20
    # Keys from 17 on: blocks 0..3 go back, so 4 more blocks fit in a pool with none free.
    assert kv.allocate_slots(r, 16) is not None
    assert kv.num_held_blocks(r) == 5 and kv.pool.num_free_blocks == 0
    before = (list(r.block_ids), kv.pool.num_free_blocks)
    r.num_computed_tokens = 36
    assert kv.allocate_slots(r, 4 * 4 + 1) is None  # keys from 33: 1 back, 5 needed
    assert (r.block_ids, kv.pool.num_free_blocks) == before


def test_prefix_hits_attach_only_the_blocks_inside_the_window():
    sched = make_scheduler(num_blocks=30, block_size=4, window=8, budget=64)
    a = make_request("a", prompt_of(41), max_tokens=1)
    sched.add_request(a)
    runner = WindowRunner(sched)
    runner.run()
    # a's full blocks were published as it went; the ones that slid out stay cached while free.
    b = make_request("b", prompt_of(41) + [5, 6, 7], max_tokens=3, arrival=1)
    sched.add_request(b)
    out = runner.step()
    assert b.num_cached_tokens == 40 and out.scheduled[0].num_new_tokens == 4
    # The first new token (40) sees keys from 33 on: blocks 8, 9 of the 10 hits are attached.
    assert b.block_ids[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in b.block_ids[8:]
    runner.run()
    assert b.output_token_ids == [FILLER] * 3
    assert sched.kv_cache.num_hit_tokens == 40


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
def test_preempted_requests_resume_and_read_their_own_window(host_blocks):
    # 12 blocks of 4, window 8: each request holds at most 4 blocks decoding, 6 in a 16-token
    # chunk; four of them cannot all run, so some are preempted and come back.
    sched = make_scheduler(num_blocks=12, block_size=4, window=8, budget=24, host_blocks=host_blocks)
    reqs = [make_request(f"r{i}", prompt_of(20 + 3 * i, 100 * i), max_tokens=30, arrival=i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    runner = WindowRunner(sched)
    runner.run()
    assert all(r.output_token_ids == [FILLER] * 30 for r in reqs)
    modes = sched.preemptor.num_preemptions_by_mode
    assert sched.num_preemptions > 0
    assert modes[SWAP if host_blocks else RECOMPUTE] > 0


def test_a_swap_moves_only_the_window_blocks():
    sched = make_scheduler(num_blocks=12, block_size=4, window=8, budget=24, max_num_seqs=1, host_blocks=64,
                           policy="priority")
    low = make_request("low", prompt_of(30), max_tokens=40, priority=5)
    sched.add_request(low)
    runner = WindowRunner(sched)
    while low.num_computed_tokens < 50:
        runner.step()
    c = low.num_computed_tokens
    window_blocks = low.block_ids[max(0, c - 8 + 1) // 4 : -(-c // 4)]
    sched.add_request(make_request("high", prompt_of(40, 1000), max_tokens=2, arrival=1, priority=0))
    out = runner.step()
    assert out.preempted == [low]
    # The 3 blocks of the window travel, not the 13 that 50 tokens would fill.
    assert [b for b, _ in out.blocks_to_swap_out] == window_blocks and len(window_blocks) == 3
    runner.run()
    assert low.output_token_ids == [FILLER] * 40
    assert sched.preemptor.num_preemptions_by_mode[SWAP] == 1


def test_predictive_admission_counts_a_window_of_blocks():
    def admitted(window):
        sched = make_scheduler(num_blocks=24, block_size=4, window=window, budget=256, admission="predictive")
        for i in range(4):
            sched.add_request(make_request(f"r{i}", prompt_of(16, 100 * i), max_tokens=100, arrival=i))
        sched.schedule()
        return len(sched.running)

    # Without a window each request is expected to grow to 29 blocks: one at a time. With a
    # window of 8 each holds 3 or 4.
    assert admitted(None) == 1
    assert admitted(8) == 4


def test_max_blocks_held():
    kv = KVCacheManager(10, 4, sliding_window=8)
    # Decoding token n (position n-1) reads keys n-8 .. n-1: two blocks when they align, else three.
    assert [kv.max_blocks_held(n) for n in (1, 8, 9, 12, 13, 100)] == [1, 2, 3, 2, 3, 2]
    assert KVCacheManager(10, 4).max_blocks_held(100) == 25


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    window=st.sampled_from([1, 3, 5, 8]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 4),
    caching=st.booleans(),
    host_blocks=st.sampled_from([0, 16]),
    spare_blocks=st.integers(0, 4),
    specs=st.lists(st.tuples(st.lists(st.sampled_from([0, 1]), min_size=1, max_size=20), st.integers(1, 12)),
                   min_size=1, max_size=5),
)
def test_random_workloads_read_their_own_window(block_size, window, budget, max_num_seqs, caching, host_blocks,
                                                 spare_blocks, specs):
    # The pool fits the largest step alone (a chunk of the whole budget) plus a few blocks.
    need = held_bound(window, budget, block_size)
    sched = make_scheduler(need + spare_blocks, block_size, window, budget=budget, max_num_seqs=max_num_seqs,
                           caching=caching, host_blocks=host_blocks)
    reqs = [make_request(f"r{i}", p, max_tokens=m, arrival=float(i)) for i, (p, m) in enumerate(specs)]
    for r in reqs:
        sched.add_request(r)
    WindowRunner(sched).run()
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [FILLER] * r.max_tokens
