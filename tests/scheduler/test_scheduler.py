"""Scheduler tests with a fake runner: no model, just the step loop
``out = schedule(); sampled = {...}; update(out, sampled)``.

The fake runner keeps an "echo" paged KV cache (slot -> token id): each step it writes every
scheduled token's id into the slot the model would write its K/V to, then checks that every
scheduled request's context (its computed tokens plus this chunk) reads back as its own tokens.
That catches wrong block tables, prefix hits on KV that was never written or was overwritten,
and blocks shared by two requests with different contents, without a model.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler
from deepbatch.core.scheduler_output import SchedulerOutput
from tests.scheduler.commit import commit_step

FILLER = 7  # what the fake model samples unless told otherwise; never a stop token here


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    arrival: float = 0.0,
    priority: int = 0,
    **params,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(prompt), sp, max_tokens, arrival_time=arrival, priority=priority)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    budget: int = 8192,
    max_num_seqs: int = 256,
    policy: str = "fcfs",
    max_model_len: int = 4096,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    # Arrival times here are synthetic small numbers, so aging (which compares them with the
    # clock) is off.
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy, priority_aging_s=0)
    return Scheduler(cfg, kv, max_model_len)


def prompt_of(n: int, start: int = 100) -> list[int]:
    """n distinct tokens: no accidental prefix sharing between prompts with different starts."""
    return list(range(start, start + n))


class FakeRunner:
    """Drives a Scheduler the way the engine does, checking its contract at every step."""

    def __init__(self, sched: Scheduler, sample: Callable[[Request], int] | None = None):
        self.sched = sched
        self.sample = sample or (lambda r: FILLER)
        self.kv: dict[int, int] = {}
        self.steps: list[SchedulerOutput] = []
        self.finished: list[Request] = []
        self.num_steps = 0
        self.mixed_steps = 0  # steps that ran prefill chunks and decodes together

    @property
    def bs(self) -> int:
        return self.sched.kv_cache.block_size

    def slot(self, r: Request, pos: int) -> int:
        return r.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        sched = self.sched
        cfg = sched.config
        running_before = sorted(sched.running, key=lambda r: (r.priority, r.arrival_time))

        out = sched.schedule()
        self.num_steps += 1
        self.steps.append(out)

        # Limits of one step.
        assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        for s in out.scheduled:
            r = s.request
            assert s.num_new_tokens >= 1
            assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
            assert r.status == RequestStatus.RUNNING and r in sched.running
            # Its blocks cover everything the model will have in cache after this step.
            assert len(r.block_ids) * self.bs >= r.num_computed_tokens + s.num_new_tokens

        # Preemption takes from the end of the (priority, arrival) order: the victims of one step
        # are exactly the last ones of the running list as it stood, last first.
        k = len(out.preempted)
        if k:
            assert out.preempted == running_before[::-1][:k]
        for r in out.preempted:
            assert r.status == RequestStatus.PREEMPTED
            assert r.block_ids == [] and r.num_computed_tokens == 0
            assert r in sched.waiting and r.request_id not in ids
        for r in out.finished:
            assert r.status == RequestStatus.FINISHED_ERROR and r.error
            assert r.block_ids == []
            assert r not in sched.running and r not in sched.waiting
        self.finished.extend(out.finished)
        self.check_block_accounting()

        # The fake model: write this step's KV, then read every scheduled context back. All
        # writes come before any read, as in a forward pass (each layer caches K/V, then attends).
        for s in out.scheduled:
            r = s.request
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
                self.kv[self.slot(r, pos)] = r.all_token_ids[pos]
        for s in out.scheduled:
            r = s.request
            n = r.num_computed_tokens + s.num_new_tokens
            got = [self.kv.get(self.slot(r, p)) for p in range(n)]
            assert got == r.all_token_ids[:n], f"{r.request_id} reads someone else's KV"

        phases = {s.request.is_prefill for s in out.scheduled}
        self.mixed_steps += phases == {True, False}
        sampled = {s.request.request_id: self.sample(s.request) for s in out.scheduled if s.samples}
        finished = commit_step(sched, out, sampled)
        for r in finished:
            assert r.is_finished and r.block_ids == []
            assert r not in sched.running
        self.finished.extend(finished)
        self.check_block_accounting()
        return out, finished

    def check_block_accounting(self) -> None:
        pool = self.sched.kv_cache.pool
        owners = Counter(b for r in self.sched.running for b in r.block_ids)
        for r in self.sched.waiting:
            assert r.block_ids == [], "a waiting request holds blocks"
        for b in pool.blocks:
            assert b.ref_cnt == owners[b.block_id], f"block {b.block_id} leaked or double-owned"
            assert (b.ref_cnt > 0) != pool.is_free(b.block_id)

    def run(self, max_steps: int = 1000) -> None:
        while self.sched.has_unfinished():
            assert self.num_steps < max_steps, "the scheduler stopped making progress"
            self.step()
        assert_all_blocks_free(self.sched)


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def by_id(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


# -- limits ----------------------------------------------------------------------------------


def test_budget_and_seats_are_never_exceeded():
    sched = make_scheduler(num_blocks=200, block_size=4, budget=20, max_num_seqs=3)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", prompt_of(5 + 7 * i, start=1000 * i), max_tokens=5, arrival=i))
    runner = FakeRunner(sched)
    runner.run()  # the per-step asserts are in FakeRunner.step
    # Both limits were actually reached, so the per-step checks ran at the edge, not below it.
    assert max(o.num_scheduled_tokens for o in runner.steps) == 20
    assert max(len(o.scheduled) for o in runner.steps) == 3
    assert all(r.num_output_tokens == 5 for r in runner.finished)
    assert len(runner.finished) == 8


def test_a_request_is_admitted_only_when_a_seat_is_free():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt_of(4, 100 * i), max_tokens=3, arrival=i))
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert set(by_id(out)) == {"r0", "r1"}
    assert [r.request_id for r in sched.waiting] == ["r2"]
    runner.run()


def test_set_limits_binds_from_the_next_step_and_never_passes_the_configured_maxima():
    sched = make_scheduler(num_blocks=200, block_size=4, budget=20, max_num_seqs=3)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt_of(4, start=1000 * i), max_tokens=4, arrival=i))
    sched.set_limits(2, 6)
    runner = FakeRunner(sched)
    out, _ = runner.step()  # configured 3 seats and 20 tokens would take three whole prompts
    assert len(out.scheduled) == 2 and out.num_scheduled_tokens == 6
    for bad in ((4, 10), (2, 21), (0, 10), (2, 0)):
        with pytest.raises(ValueError, match="set_limits"):
            sched.set_limits(*bad)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (2, 6)
    runner.run()


# -- chunked prefill and mixing --------------------------------------------------------------


def test_chunked_prefill_takes_ceil_prompt_over_budget_steps():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", prompt_of(50), max_tokens=3))
    runner = FakeRunner(sched)
    chunks = []
    while not sched.requests["a"].output_token_ids:
        out, _ = runner.step()
        chunks.append(by_id(out)["a"])
    assert len(chunks) == math.ceil(50 / 16)
    assert chunks == [16, 16, 16, 2]
    runner.run()


def test_prefill_chunks_share_the_step_with_decodes():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("short", prompt_of(3, 100), max_tokens=20, arrival=0))
    sched.add_request(make_request("long", prompt_of(50, 200), max_tokens=2, arrival=1))
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert by_id(out) == {"short": 3, "long": 13}
    # From now on "short" decodes one token a step while "long" prefills in the rest of the budget.
    mixed = 0
    while sched.requests.get("long") is not None and sched.requests["long"].is_prefill:
        out, _ = runner.step()
        got = by_id(out)
        assert got["short"] == 1
        assert got["long"] == min(15, 50 - (sched.requests["long"].num_computed_tokens - got["long"]))
        assert out.num_scheduled_tokens <= 16
        mixed += 1
    assert mixed >= 2
    runner.run()


def test_decodes_of_running_requests_come_before_new_prefills():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", prompt_of(4, 100), max_tokens=10, arrival=0))
    sched.add_request(make_request("b", prompt_of(4, 200), max_tokens=10, arrival=1))
    runner = FakeRunner(sched)
    runner.step()  # both prefill; both sample their first token
    sched.add_request(make_request("big", prompt_of(60, 300), max_tokens=2, arrival=2))
    out, _ = runner.step()
    # A new prompt big enough to eat the whole budget still only gets what the decodes leave.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("big", 14)]
    runner.run()


def test_an_unfinished_prefill_continues_before_a_new_one_starts():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("first", prompt_of(40, 100), max_tokens=2, arrival=0))
    runner = FakeRunner(sched)
    runner.step()
    sched.add_request(make_request("second", prompt_of(40, 200), max_tokens=2, arrival=1))
    out, _ = runner.step()
    assert by_id(out) == {"first": 16}
    runner.run()


# -- prefix cache ----------------------------------------------------------------------------


def test_prefix_hit_skips_all_full_blocks_but_the_last_token():
    sched = make_scheduler(block_size=16, budget=256)
    prompt = prompt_of(64)
    sched.add_request(make_request("a", prompt, max_tokens=3, arrival=0))
    runner = FakeRunner(sched)
    runner.run()
    sched.add_request(make_request("b", prompt, max_tokens=3, arrival=1))
    out, _ = runner.step()
    b = out.scheduled[0].request
    # The last token's logits must be computed, so the hit stops at floor((64-1)/16) blocks.
    assert b.num_cached_tokens == 48
    assert by_id(out) == {"b": 16}
    runner.run()
    assert b.output_token_ids == [FILLER] * 3


def test_prefix_hit_on_blocks_computed_in_the_same_step():
    # The second request is admitted in the step that computes the first one's prompt; the
    # blocks are published when allocated, and the fake model's KV check shows they are written
    # before they are read.
    sched = make_scheduler(block_size=16, budget=256)
    prompt = prompt_of(64)
    sched.add_request(make_request("a", prompt, max_tokens=2, arrival=0))
    sched.add_request(make_request("b", prompt, max_tokens=2, arrival=1))
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert by_id(out) == {"a": 64, "b": 16}
    assert sched.requests["b"].num_cached_tokens == 48
    runner.run()


@pytest.mark.parametrize(
    "second, cached",
    [
        (prompt_of(65), 64),  # one token past the blocks: all four blocks hit
        (prompt_of(40) + [1] * 24, 32),  # diverges inside block 2
        ([1] + prompt_of(63, 101), 0),  # diverges in the first token: chained hashes all differ
        (prompt_of(15), 0),  # shorter than one block
    ],
)
def test_prefix_hit_length(second, cached):
    sched = make_scheduler(block_size=16, budget=256)
    sched.add_request(make_request("a", prompt_of(64), max_tokens=2, arrival=0))
    runner = FakeRunner(sched)
    runner.run()
    sched.add_request(make_request("b", second, max_tokens=2, arrival=1))
    runner.step()
    assert sched.requests["b"].num_cached_tokens == cached
    runner.run()


def test_no_prefix_hits_with_caching_disabled():
    sched = make_scheduler(block_size=16, budget=256, caching=False)
    sched.add_request(make_request("a", prompt_of(64), max_tokens=2, arrival=0))
    runner = FakeRunner(sched)
    runner.run()
    sched.add_request(make_request("b", prompt_of(64), max_tokens=2, arrival=1))
    out, _ = runner.step()
    assert sched.requests["b"].num_cached_tokens == 0
    assert by_id(out) == {"b": 64}
    runner.run()


# -- preemption ------------------------------------------------------------------------------


def test_preemption_by_recompute_in_a_small_pool():
    # 8 blocks of 4 tokens; each request grows to 6 + 10 - 1 = 15 computed tokens (4 blocks),
    # so any one fits alone but three cannot run to the end together.
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    reqs = [make_request(f"r{i}", prompt_of(6, 100 * i), max_tokens=10, arrival=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.run()  # FakeRunner checks each step's victims are the last in (priority, arrival)
    assert sched.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    # The earliest arrival is never a victim: it is first in line whenever blocks run out.
    assert reqs[0].num_preemptions == 0
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [FILLER] * 10


def victims_in_order(sched: Scheduler, reqs: list[Request]) -> list[str]:
    runner = FakeRunner(sched)
    victims = []
    while sched.has_unfinished():
        assert runner.num_steps < 500
        out, _ = runner.step()
        victims += [r.request_id for r in out.preempted]
    assert_all_blocks_free(sched)
    for r in reqs:
        assert r.num_output_tokens == r.max_tokens
    return victims


def test_the_latest_arrival_is_preempted_first_among_equal_priorities():
    # 4 blocks of 4: each request alone needs 4 + 12 - 1 = 15 tokens = 4 blocks.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    reqs = [make_request("early", prompt_of(4, 100), max_tokens=12, arrival=1.0),
            make_request("late", prompt_of(4, 200), max_tokens=12, arrival=2.0)]
    for r in reqs:
        sched.add_request(r)
    victims = victims_in_order(sched, reqs)
    assert victims and set(victims) == {"late"}


def test_lower_priority_is_preempted_before_a_later_arrival():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    reqs = [make_request("early-low", prompt_of(4, 100), max_tokens=12, arrival=1.0, priority=1),
            make_request("late-high", prompt_of(4, 200), max_tokens=12, arrival=2.0, priority=0)]
    for r in reqs:
        sched.add_request(r)
    victims = victims_in_order(sched, reqs)
    assert victims and set(victims) == {"early-low"}


def test_a_preempted_request_is_readmitted_and_recomputes_its_outputs():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=False)
    a = make_request("a", prompt_of(4, 100), max_tokens=12, arrival=1.0)
    b = make_request("b", prompt_of(4, 200), max_tokens=12, arrival=2.0)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched, sample=lambda r: 1000 + r.num_output_tokens)
    while not b.num_preemptions:
        out, _ = runner.step()
    assert out.preempted == [b]
    n_out = b.num_output_tokens
    assert n_out > 0
    assert sched.waiting[0] is b  # back at the front of the line
    while b.status != RequestStatus.RUNNING:
        out, _ = runner.step()
    # Re-admitted: with no prefix cache it recomputes prompt plus every output so far in one go.
    assert by_id(out)["b"] == 4 + n_out
    runner.run()
    assert b.output_token_ids == [1000 + i for i in range(12)]


def test_a_victim_goes_back_to_the_front_of_the_line():
    # "c" arrives while both seats are taken; the victim "b" arrived before it and had already
    # started, so it must not fall behind "c".
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, max_num_seqs=2)
    a = make_request("a", prompt_of(4, 100), max_tokens=12, arrival=1.0)
    b = make_request("b", prompt_of(4, 200), max_tokens=12, arrival=2.0)
    c = make_request("c", prompt_of(4, 300), max_tokens=2, arrival=3.0)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.step()
    sched.add_request(c)
    while not b.num_preemptions:
        runner.step()
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    runner.run()
    assert [r.num_output_tokens for r in (a, b, c)] == [12, 12, 2]


def test_a_victim_is_not_readmitted_in_the_step_that_preempted_it():
    # 3 one-token blocks. Step 2: "a" takes the last free block, so "b" must preempt itself; that
    # frees a block and leaves budget, so only the rule stops "b" from coming straight back
    # (it would recompute for nothing and be preempted again).
    sched = make_scheduler(num_blocks=3, block_size=1, budget=2, caching=False)
    a = make_request("a", [5], max_tokens=2, arrival=1.0)
    b = make_request("b", [6], max_tokens=2, arrival=2.0)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.step()
    out, _ = runner.step()
    assert out.preempted == [b]
    assert by_id(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and sched.waiting[0] is b
    runner.run()
    assert b.output_token_ids == [FILLER] * 2


# -- a request that can never fit ------------------------------------------------------------


def test_a_request_that_cannot_fit_alone_is_ended_with_an_error_when_chunked():
    # 2 blocks of 16 = 32 tokens for a 50-token prompt. The engine would refuse it; built
    # directly, the scheduler must end it rather than preempt it forever.
    sched = make_scheduler(num_blocks=2, block_size=16, budget=16)
    big = make_request("big", prompt_of(50, 100), max_tokens=2, arrival=0)
    small = make_request("small", prompt_of(5, 200), max_tokens=2, arrival=1)
    sched.add_request(big)
    sched.add_request(small)
    runner = FakeRunner(sched)
    runner.run(max_steps=20)
    assert big.status == RequestStatus.FINISHED_ERROR
    assert big.finish_reason == "error" and big.error
    assert "big" not in sched.requests
    assert big in runner.finished
    # The request behind it is not starved.
    assert small.status == RequestStatus.FINISHED_LENGTH and small.num_output_tokens == 2


def test_a_request_that_cannot_fit_alone_is_ended_with_an_error_when_not_chunked():
    # The same 50-token prompt in 2 blocks, but the budget covers the whole prompt: admission
    # itself fails, nothing is running that could ever free a block.
    sched = make_scheduler(num_blocks=2, block_size=16, budget=64)
    big = make_request("big", prompt_of(50, 100), max_tokens=2, arrival=0)
    sched.add_request(big)
    runner = FakeRunner(sched)
    runner.run(max_steps=20)
    assert big.status == RequestStatus.FINISHED_ERROR


# -- finish_request (abort) ------------------------------------------------------------------


def test_abort_of_a_running_request_frees_its_blocks_at_once():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    a = make_request("a", prompt_of(10, 100), max_tokens=20, arrival=0)
    b = make_request("b", prompt_of(6, 200), max_tokens=3, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.step()
    runner.step()
    held = list(a.block_ids)
    assert held and all(not sched.kv_cache.pool.is_free(x) for x in held)
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and all(sched.kv_cache.pool.is_free(x) for x in held)
    assert a not in sched.running and "a" not in sched.requests
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None  # already gone
    runner.run()
    assert a.num_output_tokens < 20  # it really stopped
    assert b.num_output_tokens == 3


def test_abort_of_a_waiting_request_removes_it_from_the_queue():
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", prompt_of(4, 100), max_tokens=3, arrival=0)
    b = make_request("b", prompt_of(4, 200), max_tokens=3, arrival=1)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.step()
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert b not in sched.waiting and b.status == RequestStatus.FINISHED_ABORTED
    runner.run()
    assert b.num_output_tokens == 0


def test_unknown_request_id_is_not_an_error():
    assert make_scheduler().finish_request("nope", RequestStatus.FINISHED_ABORTED) is None


# -- stop conditions in update ---------------------------------------------------------------


def run_one(req: Request, tokens: list[int], max_model_len: int = 4096) -> Request:
    """Run one request alone, the fake model sampling ``tokens`` in order."""
    sched = make_scheduler(block_size=4, max_model_len=max_model_len)
    sched.add_request(req)
    it = iter(tokens)
    FakeRunner(sched, sample=lambda r: next(it)).run(max_steps=100)
    return req


def with_eos(req: Request, *eos: int) -> Request:
    req.sampling_params = dataclasses.replace(req.sampling_params, _eos_token_ids=frozenset(eos))
    return req


def test_eos_stops_and_is_kept_as_the_last_output_token():
    r = run_one(with_eos(make_request("r", [3, 4], max_tokens=10), 2), [5, 6, 2, 8, 8])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.output_token_ids == [5, 6, 2]
    assert r.stop_reason is None  # EOS is not a stop token id


def test_ignore_eos_runs_to_max_tokens():
    r = run_one(with_eos(make_request("r", [3, 4], max_tokens=4, ignore_eos=True), 2), [2, 2, 2, 2, 2])
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [2, 2, 2, 2]


def test_stop_token_id_stops_and_is_reported():
    r = run_one(with_eos(make_request("r", [3, 4], max_tokens=10, stop_token_ids=[9]), 2), [5, 9, 8])
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [5, 9]
    assert r.stop_reason == 9


def test_stop_token_ids_apply_even_with_ignore_eos():
    r = run_one(make_request("r", [3, 4], max_tokens=10, stop_token_ids=[9], ignore_eos=True), [9])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [9]


def test_min_tokens_holds_back_eos_and_stop_ids():
    r = run_one(
        with_eos(make_request("r", [3, 4], max_tokens=10, min_tokens=3, stop_token_ids=[9]), 2),
        [2, 9, 2, 8],
    )
    # EOS at 1 and the stop id at 2 come before min_tokens; EOS as the 3rd token may stop.
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [2, 9, 2]


def test_max_tokens_stops_with_length():
    r = run_one(with_eos(make_request("r", [3, 4], max_tokens=4), 2), [5] * 10)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"
    assert r.output_token_ids == [5, 5, 5, 5]


def test_max_tokens_wins_when_the_last_token_is_not_a_stop():
    r = run_one(with_eos(make_request("r", [3, 4], max_tokens=2, stop_token_ids=[9]), 2), [5, 9])
    # The stop id arrives exactly at max_tokens: it is a stop, not a length.
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_max_model_len_stops_with_length():
    r = run_one(make_request("r", [3, 4, 5, 6, 7, 8], max_tokens=10), [5] * 10, max_model_len=8)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 8 and r.num_output_tokens == 2


def test_update_without_a_sampled_token_only_advances_counters():
    # A chunk that does not reach the newest token samples nothing; update must not invent one.
    sched = make_scheduler(block_size=4, budget=8)
    r = make_request("r", prompt_of(20), max_tokens=2)
    sched.add_request(r)
    runner = FakeRunner(sched)
    out, finished = runner.step()  # update(out, {}): nothing reached the newest token
    assert not out.scheduled[0].samples and finished == []
    assert r.num_computed_tokens == 8 and r.output_token_ids == []
    runner.run()


# -- policy ----------------------------------------------------------------------------------


def test_priority_policy_orders_waiting_by_priority_then_arrival():
    sched = make_scheduler(policy="priority")
    spec = [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", 0, 0.5), ("f", 1, 2.0)]
    for rid, prio, arrival in spec:
        sched.add_request(make_request(rid, prompt_of(4), priority=prio, arrival=arrival))
    # Ties in (priority, arrival) keep insertion order ("c" before "f").
    assert [r.request_id for r in sched.waiting] == ["e", "b", "d", "c", "f", "a"]


def test_fcfs_policy_ignores_priority_in_the_queue():
    sched = make_scheduler(policy="fcfs")
    for i, prio in enumerate([2, 0, 1]):
        sched.add_request(make_request(f"r{i}", prompt_of(4), priority=prio, arrival=float(i)))
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2"]


def test_priority_policy_admits_in_priority_order():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for i, prio in enumerate([3, 1, 2, 0]):
        sched.add_request(make_request(f"p{prio}", prompt_of(4, 100 * i), max_tokens=2, priority=prio, arrival=float(i)))
    runner = FakeRunner(sched)
    order = []
    while sched.has_unfinished():
        out, _ = runner.step()
        order += [s.request.request_id for s in out.scheduled if s.request.request_id not in order]
    assert order == ["p0", "p1", "p2", "p3"]
    assert_all_blocks_free(sched)


def test_priority_policy_keeps_a_preempted_low_priority_request_behind_higher_ones():
    # "high" and "low" run; "mid" then waits for a seat. When blocks run out, "low" is preempted;
    # under the priority policy the next free seat belongs to "mid", not to "low".
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=2, policy="priority")
    high = make_request("high", prompt_of(4, 100), max_tokens=12, priority=0, arrival=0.0)
    low = make_request("low", prompt_of(4, 200), max_tokens=12, priority=5, arrival=1.0)
    mid = make_request("mid", prompt_of(4, 300), max_tokens=2, priority=1, arrival=2.0)
    sched.add_request(high)
    sched.add_request(low)
    runner = FakeRunner(sched)
    runner.step()
    sched.add_request(mid)  # arrives while both seats are taken
    out, _ = runner.step()
    while not low.num_preemptions:
        out, _ = runner.step()
    # From the preemption step on, the first of the two to be scheduled must be "mid" alone
    # (it fits: it needs one block and there are two free).
    while not ({"mid", "low"} & set(by_id(out))):
        out, _ = runner.step()
    assert "mid" in by_id(out) and "low" not in by_id(out)
    runner.run()


# -- everything at once ----------------------------------------------------------------------

# Small step limits and pools, and requests as (prompt, max_tokens, priority).
STEP_SHAPES = dict(
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    spare_blocks=st.integers(0, 6),
    specs=st.lists(
        st.tuples(
            st.lists(st.sampled_from([0, 1]), min_size=1, max_size=12),  # tiny vocab: shared prefixes
            st.integers(1, 6),  # max_tokens
            st.integers(0, 2),  # priority
        ),
        min_size=1,
        max_size=6,
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    **STEP_SHAPES,
    sampled=st.sampled_from([0, 1]),
)
def test_random_workloads_finish_with_exact_outputs_and_free_every_block(
    block_size, budget, max_num_seqs, policy, caching, spare_blocks, specs, sampled
):
    # The pool fits the biggest request alone (as the engine's admission guarantees) plus a few
    # blocks, so preemption is common but every request can finish.
    need = max(-(-(len(p) + m) // block_size) for p, m, _ in specs)
    sched = make_scheduler(
        num_blocks=need + spare_blocks, block_size=block_size, budget=budget,
        max_num_seqs=max_num_seqs, policy=policy, caching=caching,
    )
    reqs = [make_request(f"r{i}", p, max_tokens=m, priority=prio, arrival=float(i))
            for i, (p, m, prio) in enumerate(specs)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched, sample=lambda r: sampled)
    runner.run(max_steps=2000)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [sampled] * r.max_tokens
    assert sched.requests == {}
    if sched.num_preemptions:
        event("preempted")
    if any(r.num_cached_tokens > 0 for r in reqs):
        event("prefix hit")
    if runner.mixed_steps:
        event("prefill mixed with decode")
