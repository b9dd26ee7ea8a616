"""Scheduling policies on a simulated runner (no model): fair share between tenants, priority
without inversion, aging against starvation, per-tenant limits, static batching."""

from __future__ import annotations

import itertools

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler
from tests.scheduler.commit import commit_step

_ids = itertools.count()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(policy="fcfs", num_blocks=256, max_num_seqs=4, budget=64, **kw):
    clock = Clock()
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy, **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, 16), 4096, clock=clock), clock


def req(clock, tenant="default", priority=0, prompt_len=16, max_tokens=16):
    n = next(_ids)
    # Distinct prompts: no prefix-cache hits between requests.
    return Request(f"r{n}", [n % 30000 + 10] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens,
                   arrival_time=clock.t, priority=priority, tenant=tenant)


def step(sched, clock, tokens_by_tenant=None):
    out = sched.schedule()
    for s in out.scheduled:
        if tokens_by_tenant is not None:
            tokens_by_tenant[s.request.tenant] = tokens_by_tenant.get(s.request.tenant, 0) + s.num_new_tokens
    commit_step(sched, out, {s.request.request_id: 5 for s in out.scheduled if s.samples})
    clock.t += 0.01  # a simulated step time
    return out


def drain(sched, clock, max_steps=10_000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched, clock)
    raise AssertionError("did not drain")


def run_two_tenants(policy):
    """Tenant "heavy" offers 10x the load of "light"; both stay backlogged."""
    sched, clock = make(policy)
    served: dict[str, int] = {}
    for t in range(400):
        for _ in range(10):
            sched.add_request(req(clock, "heavy"))
        if t % 1 == 0:
            sched.add_request(req(clock, "light"))
        step(sched, clock, served if t >= 50 else None)  # measure after warm-up
    return served


def test_fair_share_between_tenants_at_10_to_1_load():
    served = run_two_tenants("fair")
    share = served["light"] / (served["light"] + served["heavy"])
    assert abs(share - 0.5) <= 0.05, share


def test_fcfs_gives_no_fair_share_to_the_light_tenant():
    # The same load under FCFS: the light tenant gets only its share of arrivals (1/11).
    served = run_two_tenants("fcfs")
    share = served.get("light", 0) / sum(served.values())
    assert share < 0.15, share


def test_fair_share_light_tenant_not_starved_and_everyone_finishes():
    sched, clock = make("fair")
    requests = [req(clock, "heavy") for _ in range(60)] + [req(clock, "light") for _ in range(6)]
    for r in requests:
        sched.add_request(r)
    admitted = []
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        out = step(sched, clock)
        admitted += [s.request for s in out.scheduled if s.request.num_computed_tokens == s.num_new_tokens]
    # Seats are not preempted under fair share; the first batch is heavy's (it came first), and
    # every seat freed after that goes to the light tenant until it has caught up.
    assert [r.tenant for r in admitted[4:8]] == ["light"] * 4
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert sched.kv_cache.pool.num_free_blocks == 256


def test_returning_tenant_does_not_bank_idle_credit():
    sched, clock = make("fair")
    for _ in range(8):
        sched.add_request(req(clock, "a"))
    drain(sched, clock)
    # "b" arrives later; it starts level with the active tenants, not at zero.
    for _ in range(8):
        sched.add_request(req(clock, "a"))
    sched.add_request(req(clock, "b"))
    policy = sched.policy
    assert policy.virtual_tokens["a"] > 0
    assert policy.virtual_tokens["b"] == policy.virtual_tokens["a"]


def test_priority_preempts_when_seats_are_full():
    sched, clock = make("priority", max_num_seqs=2, priority_aging_s=0)
    low = [req(clock, priority=5, max_tokens=100) for _ in range(2)]
    for r in low:
        sched.add_request(r)
    step(sched, clock)
    step(sched, clock)
    high = req(clock, priority=0)
    sched.add_request(high)
    out = step(sched, clock)
    assert high in [s.request for s in out.scheduled]  # served at once
    assert out.preempted == [low[1]]  # the later low-priority request gave its seat
    drain(sched, clock)
    assert high.status == RequestStatus.FINISHED_LENGTH and all(r.status == RequestStatus.FINISHED_LENGTH for r in low)
    assert low[1].num_preemptions == 1 and low[1].priority == 5


def test_priority_preempts_when_blocks_are_full():
    # 8 blocks of 16: the two low requests (64 + outputs) hold them all.
    sched, clock = make("priority", num_blocks=8, max_num_seqs=8, priority_aging_s=0, budget=256)
    low = [req(clock, priority=5, prompt_len=60, max_tokens=40) for _ in range(2)]
    for r in low:
        sched.add_request(r)
    step(sched, clock)
    high = req(clock, priority=0, prompt_len=30)
    sched.add_request(high)
    out = step(sched, clock)
    assert high in [s.request for s in out.scheduled]
    assert low[1] in out.preempted
    drain(sched, clock)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in low + [high])


def test_fcfs_does_not_preempt_for_waiting():
    sched, clock = make("fcfs", max_num_seqs=2)
    for _ in range(2):
        sched.add_request(req(clock, priority=5, max_tokens=50))
    step(sched, clock)
    high = req(clock, priority=0)
    sched.add_request(high)
    out = step(sched, clock)
    assert high not in [s.request for s in out.scheduled] and not out.preempted


def test_aging_prevents_starvation_of_low_priority():
    sched, clock = make("priority", max_num_seqs=1, priority_aging_s=0.5)
    low = req(clock, priority=3, max_tokens=4)
    sched.add_request(low)
    # The seat is taken first by a high-priority request; more keep arriving.
    for t in range(2000):
        sched.add_request(req(clock, priority=0, max_tokens=4))
        step(sched, clock)
        if low.is_finished:
            break
    assert low.is_finished, "low-priority request starved"


def test_tenant_running_limit_and_others_not_blocked():
    sched, clock = make("fcfs", max_num_seqs=8, tenant_max_running=2)
    heavy = [req(clock, "heavy", max_tokens=8) for _ in range(10)]
    light = [req(clock, "light", max_tokens=8) for _ in range(2)]
    for r in heavy + light:
        sched.add_request(r)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        step(sched, clock)
        per_tenant = {}
        for r in sched.running:
            per_tenant[r.tenant] = per_tenant.get(r.tenant, 0) + 1
        assert all(n <= 2 for n in per_tenant.values())
    assert all(r.is_finished for r in heavy + light)
    # The light tenant ran in the first steps even though heavy's requests came first.
    assert min(r.first_scheduled_time for r in light) <= 0.01


def test_tenant_tokens_per_minute_limit():
    sched, clock = make("fcfs", max_num_seqs=8, tenant_max_tokens_per_minute=40)
    rs = [req(clock, "t", prompt_len=16, max_tokens=4) for _ in range(6)]
    for r in rs:
        sched.add_request(r)
    for _ in range(50):
        step(sched, clock)
    # 40 tokens a minute admits at most 3 requests (16-token prompts) inside the first minute.
    assert sum(1 for r in rs if r.first_scheduled_time is not None) <= 3
    clock.t += 61
    drain(sched, clock)
    assert all(r.is_finished for r in rs)


def test_static_batching_waits_for_the_whole_batch():
    sched, clock = make("fcfs", max_num_seqs=16, static_batch_size=4)
    rs = [req(clock, max_tokens=2 + i) for i in range(8)]
    for r in rs:
        sched.add_request(r)
    step(sched, clock)
    assert sched.num_running == 4
    while any(not r.is_finished for r in rs[:4]):
        assert all(r.first_scheduled_time is None for r in rs[4:])
        step(sched, clock)
    step(sched, clock)
    assert all(r.first_scheduled_time is not None for r in rs[4:])
    drain(sched, clock)
