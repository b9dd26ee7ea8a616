"""The one token-budget scheduler.

Each step spends ``max_num_batched_tokens`` over running requests first (in priority order),
then waiting ones, while seats (``max_num_seqs``) remain. A request is given
``min(tokens it still has to compute, budget left)`` tokens: a decode is 1 token, a prefill is a
chunk of its prompt, a prefix-cache hit skips tokens, and a preempted request recomputes its
prompt plus output. There is no prefill phase and no decode phase; everything falls out of that
rule.

When the KV cache cannot supply blocks for a running request, the scheduler preempts (by
recompute) the running request that sorts last: lowest priority, then latest arrival. A
preempted request goes back to the front of the waiting queue and keeps its arrival time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from deepbatch.config import SchedulerConfig
from deepbatch.engine.request import Request, RequestStatus
from deepbatch.kv_cache.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's newest token, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests ended by the scheduler itself (e.g. can never fit); already freed.
    finished: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _order_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.config.policy == "priority":
            # Insert behind every request that sorts before it (stable among equals).
            idx = len(self.waiting)
            key = _order_key(request)
            for i, other in enumerate(self.waiting):
                if key < _order_key(other):
                    idx = i
                    break
            self.waiting.insert(idx, request)
        else:
            self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside (abort, stop string). Frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        self.running.sort(key=_order_key)
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                # Preempt whoever sorts last; possibly the request itself.
                victim = self.running[-1]
                if victim is request and len(self.running) == 1:
                    # Alone and still no room: it can never fit.
                    self.running.pop()
                    self.requests.pop(request.request_id, None)
                    request.error = "request does not fit in the KV cache even when run alone"
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                    out.finished.append(request)
                    break
                self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                i += 1
                continue
            # The request was preempted or finished; self.running shrank at or after i.

        # Preempted requests keep their place in line: the front under FCFS, their sorted place
        # under the priority policy (never ahead of a higher-priority waiting request).
        if out.preempted:
            if self.config.policy == "priority":
                self.waiting = deque(sorted([*self.waiting, *out.preempted], key=_order_key))
            else:
                for request in sorted(out.preempted, key=_order_key, reverse=True):
                    self.waiting.appendleft(request)

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request in out.preempted:
                break  # do not re-admit in the step that preempted it
            hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                if self.running:
                    break  # head of line waits; the running requests free blocks as they finish
                # Nothing holds blocks and it still does not fit: it never will.
                self.waiting.popleft()
                self.requests.pop(request.request_id, None)
                request.error = "request does not fit in the KV cache even when run alone"
                self._finish(request, RequestStatus.FINISHED_ERROR)
                out.finished.append(request)
                continue
            self.kv_cache.record_prefix_query(request.num_tokens, num_hit_tokens)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters after the model ran; append sampled tokens; return the requests that
        finished through a stop condition the scheduler can see (EOS, stop ids, lengths)."""
        finished = []
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self.requests.pop(request.request_id, None)
                self._finish(request, status)
                finished.append(request)
        return finished

    # -- internals ---------------------------------------------------------------------------

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in params._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.kv_cache.free(request)
        request.status = status
        request.finished_time = time.monotonic()
