"""Predictive admission vs greedy admission under a load of 4x the KV capacity."""

from __future__ import annotations

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler
from tests.scheduler.commit import commit_step


def run(admission: str):
    # 32 blocks x 16 = 512 tokens; 32 requests that each end at 16 + 48 = 64 tokens: 4x capacity.
    kv = KVCacheManager(32, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, admission=admission), kv, 4096)
    reqs = [Request(f"r{i}", [i + 10] * 16, SamplingParams(max_tokens=48), 48) for i in range(32)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        commit_step(sched, out, {s.request.request_id: 5 for s in out.scheduled if s.samples})
        steps += 1
        assert steps < 5000
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 48 for r in reqs)
    assert kv.pool.num_free_blocks == 32
    return sched.num_preemptions, max(r.num_preemptions for r in reqs), steps


def test_predictive_admission_avoids_preemption():
    greedy, greedy_max, _ = run("greedy")
    predictive, predictive_max, _ = run("predictive")
    assert greedy > 0  # the load does force preemption when admission is greedy
    assert predictive < greedy / 4
    assert predictive_max <= 1 and greedy_max <= 8  # nobody is preempted without bound


def admission_steps(batch: int, delay_ms: float, clock_step_s: float = 0.001):
    """8 seats, 40 requests with staggered lengths, so seats free up one at a time. Returns the
    number of steps that admitted someone while others were decoding, and every request's wait
    from its first free seat (approximated by the step clock) to admission."""
    now = [0.0]
    kv = KVCacheManager(256, 16)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, admission_batch_size=batch,
                             admission_max_delay_ms=delay_ms)
    sched = Scheduler(config, kv, 4096, clock=lambda: now[0])
    reqs = [Request(f"r{i}", [7] * 20, SamplingParams(max_tokens=5 + 3 * i), 5 + 3 * i, arrival_time=0.0)
            for i in range(40)]
    for r in reqs:
        sched.add_request(r)
    mixed, group_sizes = 0, []
    while sched.has_unfinished():
        running_before = set(sched.running)
        out = sched.schedule()
        admitted = [s for s in out.scheduled if s.request not in running_before]
        if admitted and running_before:
            mixed += 1
            group_sizes.append(len(admitted))
        commit_step(sched, out, {s.request.request_id: 5 for s in out.scheduled if s.samples})
        now[0] += clock_step_s
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    return mixed, group_sizes


def test_admission_batching_groups_prefills():
    one_by_one, sizes1 = admission_steps(1, 250.0)
    grouped, sizes4 = admission_steps(4, 1e6)
    assert max(sizes1) == 1 and one_by_one >= 25
    assert min(sizes4[:-1]) >= 4 and grouped <= one_by_one / 3  # the last group may be the remainder


def test_admission_batching_delay_is_bounded():
    # A 2 ms cap at 1 ms per step: a free seat waits at most ~2 steps, so groups stay small.
    capped, sizes = admission_steps(8, 2.0)
    uncapped, _ = admission_steps(8, 1e6)
    assert capped > uncapped and max(sizes) < 8
