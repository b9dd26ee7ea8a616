"""Preemption by swap vs by recompute, with the fake runner of test_scheduler.

The swap-aware fake runner copies the echo KV of each swapped-out block into a host slot and back
into the new block on swap-in, before the step's writes (as the model runner does before the
forward). A missing, misplaced or late copy makes some request read someone else's KV back.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import RequestStatus
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.kv_cache.swap import HostBlockPool, SwapCostModel
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP, Preemptor
from deepbatch.scheduler.scheduler import Scheduler
from test_scheduler import STEP_SHAPES, FILLER, FakeRunner, assert_all_blocks_free, make_request, prompt_of

# One block of KV is 1 KiB here. Swapping b blocks costs 2*b KiB over the link; recomputing n
# tokens costs n / prefill.
FAST_LINK = dict(prefill_tokens_per_s=1e3, host_link_bytes_per_s=1e12)  # swap always wins
SLOW_LINK = dict(prefill_tokens_per_s=1e9, host_link_bytes_per_s=1e3)  # recompute always wins


def make_scheduler(num_blocks, block_size, host_blocks, link=None, budget=64, max_num_seqs=256, policy="fcfs",
                   caching=True, admission="greedy", mode="auto") -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    preemptor = Preemptor(kv)
    if host_blocks:
        preemptor = Preemptor(kv, HostBlockPool(host_blocks), SwapCostModel(**(link or FAST_LINK), kv_bytes_per_block=1024),
                              mode)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                          priority_aging_s=0, admission=admission)
    return Scheduler(cfg, kv, 4096, preemptor=preemptor)


class SwapFakeRunner(FakeRunner):
    """FakeRunner that also performs the scheduler output's swap copies on its echo KV."""

    def __init__(self, sched: Scheduler, **kw):
        super().__init__(sched, **kw)
        self.host: dict[int, list] = {}
        self.num_swapped_out = self.num_swapped_in = 0
        schedule = sched.schedule

        def schedule_and_swap():
            out = schedule()
            self.swap(out)
            return out

        sched.schedule = schedule_and_swap

    def swap(self, out) -> None:
        bs = self.bs
        for block, slot in out.blocks_to_swap_out:
            assert 0 <= slot < self.sched.preemptor.host_pool.num_blocks
            self.host[slot] = [self.kv.get(block * bs + i) for i in range(bs)]
        for slot, block in out.blocks_to_swap_in:
            for i, token in enumerate(self.host.pop(slot)):  # a slot is read back once
                self.kv[block * bs + i] = token
        self.num_swapped_out += len(out.blocks_to_swap_out)
        self.num_swapped_in += len(out.blocks_to_swap_in)

    def run(self, max_steps: int = 1000) -> None:
        super().run(max_steps)
        p = self.sched.preemptor
        assert p.num_swapped == 0 and self.host == {}
        if p.host_pool is not None:
            p.begin_step()
            assert p.host_pool.num_free_blocks == p.host_pool.num_blocks
        assert self.num_swapped_out == self.num_swapped_in


def small_pool_load(link, host_blocks=64, mode="auto"):
    # 8 blocks of 4 tokens; each request grows to 6 + 10 - 1 = 15 computed tokens (4 blocks),
    # so any one fits alone but three cannot run to the end together.
    sched = make_scheduler(8, 4, host_blocks, link, mode=mode)
    reqs = [make_request(f"r{i}", prompt_of(6, 100 * i), max_tokens=10, arrival=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = SwapFakeRunner(sched)
    runner.run()
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [FILLER] * 10
    return sched, runner


def test_cost_model_arithmetic():
    m = SwapCostModel(prefill_tokens_per_s=1000.0, host_link_bytes_per_s=1e6, kv_bytes_per_block=1000)
    assert m.recompute_seconds(500) == pytest.approx(0.5)
    assert m.swap_seconds(100) == pytest.approx(0.2)  # 100 KB out and 100 KB in at 1 MB/s
    assert m.prefer_swap(500, 100)
    assert not m.prefer_swap(200, 100)  # 0.2 s either way: a tie recomputes
    assert not m.prefer_swap(100, 100)
    with pytest.raises(ValueError):
        SwapCostModel(0.0, 1e6, 1000)


def test_swap_when_the_link_is_cheaper_than_recompute():
    sched, runner = small_pool_load(FAST_LINK)
    modes = sched.preemptor.num_preemptions_by_mode
    assert modes[SWAP] > 0 and modes[RECOMPUTE] == 0
    assert modes[SWAP] == sched.num_preemptions
    assert runner.num_swapped_out > 0


def test_recompute_when_recompute_is_cheaper():
    sched, runner = small_pool_load(SLOW_LINK)
    modes = sched.preemptor.num_preemptions_by_mode
    assert modes[RECOMPUTE] == sched.num_preemptions > 0 and modes[SWAP] == 0
    assert runner.num_swapped_out == 0


def test_a_forced_preemption_mode_overrides_the_cost_model():
    sched, _ = small_pool_load(SLOW_LINK, mode="swap")
    assert sched.preemptor.num_preemptions_by_mode == {SWAP: sched.num_preemptions, RECOMPUTE: 0}
    sched, _ = small_pool_load(FAST_LINK, mode="recompute")
    assert sched.preemptor.num_preemptions_by_mode == {SWAP: 0, RECOMPUTE: sched.num_preemptions}


def test_recompute_when_the_host_pool_is_full():
    # Each victim holds 2-4 blocks; a 1-block host pool never fits one.
    sched, runner = small_pool_load(FAST_LINK, host_blocks=1)
    assert sched.preemptor.num_preemptions_by_mode[SWAP] == 0 and sched.num_preemptions > 0


def run_until_swapped_out():
    """Two requests in 4 blocks of 4 until the later one, b, is preempted (by swap)."""
    sched = make_scheduler(4, 4, 16)
    a = make_request("a", prompt_of(5, 100), max_tokens=8, arrival=0)
    b = make_request("b", prompt_of(5, 200), max_tokens=8, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    runner = SwapFakeRunner(sched)
    while not b.num_preemptions:
        runner.step()
    return sched, runner, b


def test_a_swapped_request_resumes_without_recomputing():
    sched, runner, b = run_until_swapped_out()
    out = runner.steps[-1]
    assert out.preempted == [b] and len(out.blocks_to_swap_out) == 2  # its 5..8 computed tokens
    saved = sched.preemptor.swapped_tokens(b)
    assert saved > 0 and b.num_computed_tokens == 0 and b.block_ids == []
    while b.status != RequestStatus.RUNNING:
        out, _ = runner.step()
    # Resumed at its saved position: only the newest token runs, not the whole context again.
    assert [(s.request, s.num_new_tokens) for s in out.scheduled if s.request is b] == [(b, 1)]
    assert len(out.blocks_to_swap_in) == 2 and b.num_computed_tokens == saved + 1  # after update
    runner.run()


def test_a_victim_that_shares_prefix_blocks_is_recomputed():
    kv = KVCacheManager(16, 4)
    p = Preemptor(kv, HostBlockPool(16), SwapCostModel(**FAST_LINK, kv_bytes_per_block=1024))
    shared = prompt_of(8, 100)
    a = make_request("a", shared + [1, 2], max_tokens=4)
    b = make_request("b", shared + [3], max_tokens=4)
    for r in (a, b):
        hits, n = kv.get_computed_blocks(r)
        kv.allocate_slots(r, r.num_tokens - n, hits)
        r.num_computed_tokens = r.num_tokens
    assert b.block_ids[:2] == a.block_ids[:2]  # the two full prompt blocks are shared
    assert p.choose(b) == RECOMPUTE
    out: list = []
    assert p.preempt(b, out) == RECOMPUTE and out == []
    # Once alone, a owns all its blocks (its shared ones are now only its own) and may swap.
    assert p.choose(a) == SWAP
    blocks = list(a.block_ids)
    assert p.preempt(a, out) == SWAP
    assert [blk for blk, _ in out] == blocks and len(blocks) == 3 and p.host_pool.num_free_blocks == 13


def test_abort_of_a_swapped_request_frees_its_host_slots():
    sched, runner, b = run_until_swapped_out()
    assert sched.preemptor.host_pool.num_free_blocks < 16
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert sched.preemptor.num_swapped == 0 and sched.preemptor.host_pool.num_free_blocks == 16
    runner.host.clear()  # b's copies are never read back
    runner.num_swapped_in = runner.num_swapped_out
    runner.run()


def test_four_times_the_kv_capacity_with_swap_finishes_everyone_with_bounded_preemptions():
    # 32 blocks x 16 = 512 tokens; 32 requests that each end at 16 + 48 = 64 tokens: 4x capacity.
    sched = make_scheduler(32, 16, host_blocks=64, budget=256)
    reqs = [make_request(f"r{i}", [i + 10] * 16, max_tokens=48, arrival=i) for i in range(32)]
    for r in reqs:
        sched.add_request(r)
    runner = SwapFakeRunner(sched)
    runner.run(max_steps=5000)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 48 for r in reqs)
    assert sched.preemptor.num_preemptions_by_mode[SWAP] > 0
    assert max(r.num_preemptions for r in reqs) <= 8  # nobody is preempted without bound
    assert_all_blocks_free(sched)


def test_priority_preemption_swaps_the_low_priority_request():
    sched = make_scheduler(4, 4, 16, policy="priority")
    low = make_request("low", prompt_of(9, 100), max_tokens=6, arrival=0, priority=5)
    sched.add_request(low)
    runner = SwapFakeRunner(sched)
    runner.step()
    runner.step()
    high = make_request("high", prompt_of(9, 200), max_tokens=6, arrival=1, priority=0)
    sched.add_request(high)
    out, _ = runner.step()
    assert out.preempted == [low] and out.blocks_to_swap_out
    runner.run()
    assert low.output_token_ids == [FILLER] * 6


@settings(max_examples=200, deadline=None)
@given(**STEP_SHAPES, host_blocks=st.integers(0, 12), link=st.sampled_from([FAST_LINK, SLOW_LINK]))
def test_random_workloads_with_swap_read_back_their_own_kv(
    block_size, budget, max_num_seqs, policy, caching, spare_blocks, specs, host_blocks, link
):
    need = max(-(-(len(p) + m) // block_size) for p, m, _ in specs)
    sched = make_scheduler(need + spare_blocks, block_size, host_blocks, link, budget=budget,
                           max_num_seqs=max_num_seqs, policy=policy, caching=caching)
    reqs = [make_request(f"r{i}", p, max_tokens=m, priority=prio, arrival=float(i))
            for i, (p, m, prio) in enumerate(specs)]
    for r in reqs:
        sched.add_request(r)
    runner = SwapFakeRunner(sched)
    runner.run(max_steps=2000)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [FILLER] * r.max_tokens
    if sched.preemptor.num_preemptions_by_mode[SWAP]:
        event("swapped")
    if sched.preemptor.num_preemptions_by_mode[RECOMPUTE]:
        event("recomputed")


def test_a_swapped_request_resumes_before_later_arrivals():
    sched, runner, b = run_until_swapped_out()
    c = make_request("c", prompt_of(2, 300), max_tokens=2, arrival=2)  # small: would fit first
    sched.add_request(c)
    assert list(sched.waiting) == [b, c]
    while b.status != RequestStatus.RUNNING:
        out, _ = runner.step()
        assert c.status == RequestStatus.WAITING or b.status == RequestStatus.RUNNING, "c went ahead of b"
    ids = [s.request.request_id for s in out.scheduled]
    assert "c" not in ids or ids.index("b") < ids.index("c")
    runner.run()
