"""Predictive admission vs greedy admission under a load of 4x the KV capacity."""

from __future__ import annotations

from deepbatch.config import SchedulerConfig
from deepbatch.engine.request import Request, RequestStatus
from deepbatch.engine.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler


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
        sched.update(out, {s.request.request_id: 5 for s in out.scheduled if s.samples})
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
