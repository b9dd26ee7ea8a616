"""The one token-budget scheduler.

Each step spends ``max_num_batched_tokens`` over running requests first (in priority order),
then waiting ones, while seats (``max_num_seqs``) remain. A request is given
``min(tokens it still has to compute, budget left)`` tokens: a decode is 1 token, a prefill is a
chunk of its prompt, a prefix-cache hit skips tokens, and a preempted request recomputes its
prompt plus output. There is no prefill phase and no decode phase; everything falls out of that
rule.

The policy (``scheduler/policy.py``) only orders the queues and sets limits. Under a preemptive
policy (priority) one rank orders both queues, so the same pass goes by rank: when a waiting
request outranks a running request that is still prefilling, it is admitted at that point of
the pass and the prefill's chunk gets only what is left (possibly nothing: it keeps its progress
and continues in a later step); running decodes always keep their token::

    running, by rank:   D1  P1  D2  P2  D3          D = decode, P = prefill chunk
    waiting, by rank:   W (outranks P2, not P1)
    budget pass:        D1  P1  D2  W   P2  D3      a chunk leaves a token per decode after it

When the KV cache cannot supply blocks for a running request, the scheduler preempts the running
request that sorts last (by default: lowest priority, then latest arrival), by swap or by
recompute as ``scheduler/preemption.py`` decides; the budget alone never preempts anyone. A
preempted request keeps its arrival time and priority, so it goes back to its place in line; a
swapped one resumes by swapping in when it reaches the head.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.policy import make_policy
from deepbatch.scheduler.preemption import Preemptor


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic, preemptor: Preemptor | None = None):
        self.config = config
        self.clock = clock  # policies age and rate-limit against it; tests pass a fake one
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.policy = make_policy(config)
        # The step's limits. They start at the configured maxima; an SLO controller may lower
        # them at run time (never above the configured values, which sized memory and graphs).
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._seat_free_since: float | None = None  # admission batching: when a seat first went unused
        self.preemptor = preemptor or Preemptor(kv_cache)  # default: recompute only
        # Mean output length of finished requests (exponential moving average): the expected
        # output of a request that has not said otherwise, for predictive admission.
        self.expected_output_len = 256.0

    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """The step's limits from the next step on (the SLO controller's one way in). Never above
        the configured maxima, which sized the KV profile and the CUDA graphs."""
        cfg = self.config
        if not (1 <= max_num_seqs <= cfg.max_num_seqs and 1 <= max_num_batched_tokens <= cfg.max_num_batched_tokens):
            raise ValueError(f"set_limits: ({max_num_seqs}, {max_num_batched_tokens}) must lie within 1 and the "
                             f"configured ({cfg.max_num_seqs}, {cfg.max_num_batched_tokens})")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    # -- queue -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.policy.on_arrival(request, self.active_tenants())
        self.requests[request.request_id] = request
        # Insert in policy order (behind equals); schedule() re-sorts, since keys move with time
        # and service.
        now = self.clock()
        key = self.policy.key(request, now)
        if not self.waiting or not key < self.policy.key(self.waiting[-1], now):
            self.waiting.append(request)  # the common case: it sorts last
            return
        idx = next(i for i, r in enumerate(self.waiting) if key < self.policy.key(r, now))
        self.waiting.insert(idx, request)

    def active_tenants(self) -> set[str]:
        return {r.tenant for r in self.running} | {r.tenant for r in self.waiting}

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside (abort, stop string). Frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self._remove_running(request)
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
        budget = self.max_num_batched_tokens
        now = self.clock()
        policy = self.policy
        self.preemptor.begin_step()
        self.running.sort(key=lambda r: policy.victim_key(r, now))
        self.waiting = deque(sorted(self.waiting, key=lambda r: policy.key(r, now)))
        if policy.preemptive:
            self._preempt_for_waiting(out, budget, now)

        # Under a preemptive policy one rank orders both queues, so the budget goes by rank: a
        # running prefill chunk is served only after the waiting requests that outrank it are
        # admitted (they take its budget; it keeps its progress), and every running decode keeps
        # its one token whatever its rank (``decodes_left`` is held back from every chunk).
        by_rank = policy.preemptive
        decodes_left = sum(1 for r in self.running if self._tokens_to_run(r) == 1) if by_rank else 0
        admission_open = True
        skipped: list[Request] = []

        # Running requests in policy order; victims come from the end of that order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_todo = self._tokens_to_run(request)
            if num_todo == 0:
                i += 1  # its pending token is its last; nothing more to run
                continue
            limit = budget
            if by_rank:
                if num_todo == 1:
                    decodes_left -= 1
                else:
                    if admission_open and self.waiting and policy.key(self.waiting[0], now) < policy.key(request, now):
                        num_running = len(self.running)
                        budget, admission_open = self._admit_waiting(out, budget, now, skipped, request, decodes_left)
                        i += len(self.running) - num_running  # admitted ahead of it, by rank
                    limit = budget - decodes_left
                    if limit <= 0:
                        i += 1  # its chunk is cut to nothing this step
                        continue
            num_new = min(num_todo, limit)
            if request.spec_token_ids:
                # Drafts run after the decode's token where the budget has room to spare: every
                # running request after this one keeps a token first.
                spare = limit - num_new - (len(self.running) - i - 1)
                del request.spec_token_ids[max(spare, 0) if num_todo == 1 else 0:]
                num_new += len(request.spec_token_ids)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self.running[-1]  # possibly the request itself
                if victim is request and len(self.running) == 1:
                    self.running.pop()
                    self.policy.on_released(request)
                    self._fail_never_fits(request, out)
                    break
                if by_rank and victim is not request and self._tokens_to_run(victim) == 1:
                    decodes_left -= 1  # a decode behind this one that will not run now
                self._preempt_last(out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                policy.on_scheduled(request, num_new, now)
                budget -= num_new
                i += 1

        # Preempted requests keep their arrival (and priority), so sorting puts them back in
        # their place in line: ahead of later arrivals, behind higher-priority requests.
        if out.preempted:
            self.waiting = deque(sorted([*self.waiting, *out.preempted], key=lambda r: policy.key(r, now)))

        # Then the other waiting requests, in policy order, while budget and seats last.
        if admission_open:
            self._admit_waiting(out, budget, now, skipped)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float, skipped: list[Request],
                       outranks: Request | None = None, reserve: int = 0) -> tuple[int, bool]:
        """Admit waiting requests from the head of the line while ``budget - reserve`` and seats
        last; requests over their tenant's limits are moved to ``skipped``. With ``outranks`` (a
        running request), only those whose key sorts before it, each placed in ``running`` by
        rank. Returns the budget left and whether the line may still move this step (False once
        its head must wait for blocks or seats)."""
        policy = self.policy
        seats = self._seats(now)
        limit = None if outranks is None else policy.key(outranks, now)
        while self.waiting and budget > reserve:
            if len(self.running) >= seats:
                return budget, False
            request = self.waiting[0]
            if limit is not None and not policy.key(request, now) < limit:
                break
            if request in out.preempted:
                return budget, False  # not re-admitted in the step that preempted it
            if not policy.admissible(request, now):
                skipped.append(self.waiting.popleft())  # over its tenant's limits; others may go
                continue
            # A swapped-out request resumes from its own KV (swapped in), not from prefix hits.
            swapped = self.preemptor.swapped_tokens(request)
            hits, num_hit_tokens = ([], swapped) if swapped else self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget - reserve)
            if self.config.admission == "predictive" and self.running and not self._predicted_fit(request, hits):
                return budget, False  # would likely force a preemption later; wait for room
            if swapped:
                fits = self.preemptor.swap_in(request, num_new, out.blocks_to_swap_in)
            else:
                fits = self.kv_cache.allocate_slots(request, num_new, hits) is not None
            if not fits:
                if self.running:
                    return budget, False  # head of line waits; running requests free blocks as they finish
                self.waiting.popleft()  # nothing holds blocks and it still does not fit
                self._fail_never_fits(request, out)
                continue
            if not swapped:
                self.kv_cache.record_prefix_query(request.num_tokens, num_hit_tokens)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            if limit is None:
                self.running.append(request)
            else:
                bisect.insort(self.running, request, key=lambda r: policy.victim_key(r, now))
            policy.on_admitted(request)
            policy.on_scheduled(request, num_new, now)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return budget, True

    def _seats(self, now: float) -> int:
        """How many requests may be running once this step's admissions are done."""
        static = self.config.static_batch_size
        if static is not None:
            return min(static, self.max_num_seqs) if not self.running else 0
        return 0 if self._hold_admission(self.max_num_seqs, now) else self.max_num_seqs

    def _tokens_to_run(self, request: Request) -> int:
        """Tokens a running request still has to compute (1 for a decode); 0 when its pending
        token is its last."""
        if request.num_pending_tokens and self._reaches_length(request):
            return 0
        return request.num_tokens - request.num_computed_tokens

    def _hold_admission(self, seats: int, now: float) -> bool:
        """Admission batching (``admission_batch_size``): True while decodes run and fewer seats
        are free than the group to admit, for at most ``admission_max_delay_ms``."""
        group = min(self.config.admission_batch_size, len(self.waiting))
        free = seats - len(self.running)
        if group <= 1 or not self.running or free <= 0 or free >= group:
            self._seat_free_since = None
            return False
        if self._seat_free_since is None:
            self._seat_free_since = now
        return (now - self._seat_free_since) * 1e3 < self.config.admission_max_delay_ms

    def _expected_total(self, request: Request) -> int:
        """Tokens the request is expected to hold when it finishes."""
        expected_out = min(request.max_tokens, max(int(self.expected_output_len), request.num_output_tokens + 1))
        return request.num_prompt_tokens + expected_out

    def _predicted_fit(self, request: Request, hits: list[int]) -> bool:
        # Under a sliding window a request's blocks stop growing at about the window's worth.
        kv = self.kv_cache
        growth = sum(max(0, kv.max_blocks_held(self._expected_total(r)) - kv.num_held_blocks(r)) for r in self.running)
        need = max(0, kv.max_blocks_held(self._expected_total(request)) - len(hits))
        reserve = int(self.config.kv_watermark * kv.num_blocks)
        return need + growth + reserve <= kv.pool.num_free_blocks

    def _preempt_for_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Priority without inversion: while the best waiting request sorts before the last
        running one and is blocked by seats or KV blocks, the running one gives way."""
        policy = self.policy
        while self.waiting and self.running:
            head, last = self.waiting[0], self.running[-1]
            if not policy.key(head, now) < policy.key(last, now):
                return
            seats_full = len(self.running) >= self.max_num_seqs
            first_chunk = min(head.num_tokens, budget)
            blocks_short = self.kv_cache.blocks_needed(first_chunk) > self.kv_cache.pool.num_free_blocks
            if not (seats_full or blocks_short):
                return
            self._preempt_last(out)

    def advance(self, out: SchedulerOutput, pending: bool = True) -> None:
        """Count the step's tokens as computed once the step is launched. With ``pending``, a
        request that samples gets a pending token, so the next step can be scheduled before the
        sampled id reaches the host (async scheduling); the engine's output processor fills it in
        and decides whether the request is done (``finish_request``)."""
        for s in out.scheduled:
            request = s.request
            if request.is_finished:
                continue  # ended (stop string, abort) while its step ran; the step's token is dropped
            request.num_computed_tokens += s.num_new_tokens
            if s.samples and pending:
                request.append_pending_token()

    # -- internals ---------------------------------------------------------------------------

    def _reaches_length(self, request: Request) -> bool:
        return request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self.policy.on_released(request)

    def _fail_never_fits(self, request: Request, out: SchedulerOutput) -> None:
        self.requests.pop(request.request_id, None)
        request.error = "request does not fit in the KV cache even when run alone"
        self._finish(request, RequestStatus.FINISHED_ERROR)
        out.finished.append(request)

    def _preempt_last(self, out: SchedulerOutput) -> None:
        """The running request that sorts last gives way (by swap or by recompute)."""
        request = self.running.pop()
        request.spec_token_ids.clear()
        self.policy.on_released(request)
        self.preemptor.preempt(request, out.blocks_to_swap_out)
        out.preempted.append(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.expected_output_len += 0.1 * (request.num_output_tokens - self.expected_output_len)
        self.kv_cache.free(request)
        self.preemptor.forget(request)
        request.status = status
        request.finished_time = self.clock()
