"""The step protocol on its own: a worker's mirror, fed every StepMessage (pickled, as the queue
sends it), holds exactly the token ids, block ids and counters that rank 0's scheduler has for
each scheduled request, through chunked prefill, prefix hits, preemption, aborts and request ids
reused after they finish, synchronously and under async scheduling (a token still on the device
is a placeholder on both sides). No model, no processes."""

from __future__ import annotations

import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepbatch.config import SchedulerConfig
from deepbatch.distributed.messages import RequestMirror, StepMessage, StepMessageBuilder
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler
from tests.scheduler.commit import commit_step, commit_tokens


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def _check_step(out, mirrored) -> None:
    assert len(mirrored.scheduled) == len(out.scheduled)
    for real, mine in zip(out.scheduled, mirrored.scheduled):
        r, m = real.request, mine.request
        assert m.request_id == r.request_id
        assert m.all_token_ids == r.all_token_ids
        assert m.block_ids == r.block_ids
        assert m.num_computed_tokens == r.num_computed_tokens
        assert mine.num_new_tokens == real.num_new_tokens
        assert mine.samples == real.samples


def run_protocol(seed: int, num_requests: int, num_blocks: int, budget: int, abort_every: int,
                 pipelined: bool = False) -> dict:
    """Drive a scheduler as the engine does and check the mirror after every message. With
    ``pipelined``, as under async scheduling: step N+1 is scheduled and sent before step N's
    tokens are committed, so messages carry pending tokens."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, priority_aging_s=0),
                      KVCacheManager(num_blocks, 4, enable_caching=True), max_model_len=256)
    shared = [rng.randrange(3, 50) for _ in range(8)]  # a common prefix: prefix-cache hits
    pending = [
        _request(f"r{i % 5}", shared[: rng.randrange(0, 9)] + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))],
                 rng.randrange(1, 10))
        for i in range(num_requests)
    ]  # ids repeat: "r0" is reused once an earlier "r0" has finished
    builder, mirror = StepMessageBuilder(), RequestMirror()
    stats = {"steps": 0, "preemptions": 0, "pending": 0}
    live: dict[str, Request] = {}
    inflight = None
    while pending or sched.has_unfinished() or inflight:
        while pending and pending[0].request_id not in live:
            r = pending.pop(0)
            live[r.request_id] = r
            sched.add_request(r)
        out = sched.schedule()
        for r in out.finished:
            builder.forget(r.request_id)
            live.pop(r.request_id)
        if out.is_empty:
            if inflight:  # nothing to launch (only tokens in flight): the engine still commits
                for r in commit_tokens(sched, *inflight):
                    builder.forget(r.request_id)
                    live.pop(r.request_id)
                inflight = None
            continue
        stats["steps"] += 1
        stats["preemptions"] += len(out.preempted)
        msg = pickle.loads(pickle.dumps(builder.build(out)))
        assert isinstance(msg, StepMessage)
        _check_step(out, mirror.apply(msg))
        stats["pending"] += sum(d.num_pending_tokens for d in msg.scheduled)
        sampled = {s.request.request_id: rng.randrange(3, 50) for s in out.scheduled if s.samples}
        if pipelined:
            done = commit_tokens(sched, *inflight) if inflight else []
            sched.advance(out, pending=True)
            inflight = (out, sampled)
        else:
            done = commit_step(sched, out, sampled)
        for r in done:
            builder.forget(r.request_id)
            live.pop(r.request_id)
        if abort_every and stats["steps"] % abort_every == 0 and sched.running:
            victim = sched.running[0]
            sched.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
            builder.forget(victim.request_id)
            live.pop(victim.request_id)
    # The last finishes reach the workers with the next message.
    mirror.apply(builder.build(sched.schedule()))
    assert len(mirror) == 0
    return stats


@pytest.mark.parametrize("pipelined", [False, True])
def test_mirror_follows_preemption_and_reused_ids(pipelined):
    stats = run_protocol(seed=0, num_requests=12, num_blocks=12, budget=16, abort_every=7, pipelined=pipelined)
    assert stats["preemptions"] > 0  # the case that rebuilds block tables was exercised
    assert (stats["pending"] > 0) == pipelined


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_requests=st.integers(1, 12), num_blocks=st.integers(10, 40),
       budget=st.sampled_from([4, 16, 64]), abort_every=st.sampled_from([0, 3, 5]), pipelined=st.booleans())
def test_mirror_matches_scheduler(seed, num_requests, num_blocks, budget, abort_every, pipelined):
    run_protocol(seed, num_requests, num_blocks, budget, abort_every, pipelined)


def test_a_lost_message_is_detected():
    builder, mirror = StepMessageBuilder(), RequestMirror()
    sched = Scheduler(SchedulerConfig(), KVCacheManager(8, 4), max_model_len=64)
    sched.add_request(_request("a", [5, 6, 7], 4))
    builder.build(sched.schedule())  # never delivered
    with pytest.raises(RuntimeError, match="lost a message"):
        mirror.apply(builder.build(sched.schedule()))
