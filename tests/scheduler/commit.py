"""Drive a Scheduler without an engine: commit each sampled token and end the requests it
finishes, through the engine's own stop check (``output_processor.check_stop``)."""

from __future__ import annotations

from deepbatch.core.request import Request
from deepbatch.core.scheduler_output import SchedulerOutput
from deepbatch.engine.output_processor import check_stop
from deepbatch.scheduler.scheduler import Scheduler


def commit_step(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
    """What the engine does after a synchronous step: counters advance, each sampled token is
    recorded, and a request that meets its stop condition finishes. Returns those requests."""
    sched.advance(out, pending=False)
    return commit_tokens(sched, out, sampled)


def commit_tokens(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
    """Record a launched step's sampled tokens: into the pending places that ``advance(out,
    pending=True)`` made (async scheduling: the next step is already scheduled), else appended.
    A request that ended meanwhile drops its token. Returns the requests that finish here."""
    finished = []
    for s in out.scheduled:
        r, token = s.request, sampled.get(s.request.request_id)
        if token is None or r.is_finished:
            continue
        if r.num_pending_tokens:
            r.commit_pending_token(token)
        else:
            r.append_output_token(token)
        status = check_stop(r, token, sched.max_model_len)
        if status is not None:
            sched.finish_request(r.request_id, status)
            finished.append(r)
    return finished
