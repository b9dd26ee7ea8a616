"""What ``AsyncEngine`` checks before it accepts a request: the waiting queue's bounds, the
Retry-After of a full queue, and the request ids already in flight.

The waiting queue is bounded (``max_queued_requests`` sequences, ``max_queued_tokens`` prompt
tokens). A request larger than a bound can never be accepted and is an InvalidRequestError; one
that does not fit now gets QueueFullError with ``retry_after``: the time the queue's measured
drain rate needs to make room for it.

    QueueBounds.check_fits(seqs, tokens, n)       the request alone, against the bounds (for good)
    QueueBounds.check_room(queued, request)       the request beside what is queued (for now)
    QueueBounds.observe(...)                      one engine iteration, for the drain rate
    RequestIds.reserve(ids, n) / release(id)      ids held by requests not yet answered

None of these take a lock: the caller decides which thread owns what (``AsyncEngine``'s module
docstring).
"""

from __future__ import annotations

import math
from collections import deque

from deepbatch.core.errors import InvalidRequestError

# Retry-After: the drain rate is measured over this much recent time; before anything has been
# measured a retry is suggested after the fallback; no suggestion exceeds the cap.
_DRAIN_WINDOW_S = 10.0
_RETRY_AFTER_FALLBACK_S = 1.0
_RETRY_AFTER_MAX_S = 60.0


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queued_requests`` sequences or ``max_queued_tokens``
    prompt tokens; retry after ``retry_after`` seconds (>= 1)."""

    def __init__(self, message: str, retry_after: float = _RETRY_AFTER_FALLBACK_S):
        super().__init__(message)
        self.retry_after = retry_after


class DrainRate:
    """Sequences and prompt tokens leaving the waiting queue per second (admitted, or prefilled
    in part), over the iterations of the last ``_DRAIN_WINDOW_S`` seconds that found a backlog.
    Only those count: a request that arrives while seats are free is admitted at once, and that
    speed says nothing about how fast a full queue makes room. Fed by the engine thread;
    ``rates`` is replaced whole, so the event loop reads it without a lock."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, int, int]] = deque()  # (end, seconds, seqs, tokens)
        self._seconds = 0.0
        self._seqs = 0
        self._tokens = 0
        self.rates: tuple[float, float] | None = None  # (seqs/s, tokens/s); None: nothing measured

    def observe(self, start: float, end: float, backlog: bool, before: tuple[int, int],
                after: tuple[int, int]) -> None:
        """One iteration from ``start`` to ``end``: ``backlog`` whether requests were waiting
        when it began, ``before``/``after`` the waiting (sequences, tokens) around its step."""
        if not backlog:
            return
        sample = (end, end - start, max(0, before[0] - after[0]), max(0, before[1] - after[1]))
        self._samples.append(sample)
        self._seconds += sample[1]
        self._seqs += sample[2]
        self._tokens += sample[3]
        while self._samples[0][0] < end - _DRAIN_WINDOW_S:
            _, seconds, seqs, tokens = self._samples.popleft()
            self._seconds -= seconds
            self._seqs -= seqs
            self._tokens -= tokens
        if self._seconds > 0:
            # A window in which nothing left still bounds the rate: under one per window.
            self.rates = (max(self._seqs, 1) / self._seconds, max(self._tokens, 1) / self._seconds)

    def retry_after(self, excess_seqs: int, excess_tokens: int) -> float:
        """Seconds until ``excess_seqs`` sequences and ``excess_tokens`` tokens have left."""
        if self.rates is None:
            return _RETRY_AFTER_FALLBACK_S
        seq_rate, token_rate = self.rates
        wait = max(excess_seqs / seq_rate, excess_tokens / token_rate)
        return min(max(wait, 1.0), _RETRY_AFTER_MAX_S)


class QueueBounds:
    """The waiting queue's two bounds (None: unbounded) and the drain rate that prices a retry."""

    def __init__(self, max_queued_requests: int | None, max_queued_tokens: int | None):
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.drain_rate = DrainRate()

    def check_fits(self, num_seqs: int, num_tokens: int, n: int) -> None:
        """A request larger than a queue bound would get 429 forever, even from an idle server."""
        limit = self.max_queued_requests
        if limit is not None and num_seqs > limit:
            raise InvalidRequestError(
                "n" if n > limit else "prompt",
                f"the request needs {num_seqs} sequences (prompts x n); the waiting queue holds at most {limit}",
                code="exceeds_queue_limit")
        limit = self.max_queued_tokens
        if limit is not None and num_tokens > limit:
            raise InvalidRequestError(
                "prompt", f"the request needs {num_tokens} prompt tokens (prompt tokens x n); the waiting queue "
                f"holds at most {limit}", code="exceeds_queue_limit")

    def check_room(self, queued: tuple[int, int], request: tuple[int, int]) -> None:
        """QueueFullError unless the request's (sequences, prompt tokens) fit beside those
        ``queued`` (waiting in the engine or on their way there); a zero count is not checked."""
        num_seqs, num_tokens = request
        excess_seqs = excess_tokens = 0
        full = []
        limit = self.max_queued_requests
        if num_seqs and limit is not None:
            excess_seqs = queued[0] + num_seqs - limit
            if excess_seqs > 0:
                full.append(f"{limit} sequences")
        limit = self.max_queued_tokens
        if num_tokens and limit is not None:
            excess_tokens = queued[1] + num_tokens - limit
            if excess_tokens > 0:
                full.append(f"{limit} prompt tokens")
        if full:
            retry_after = self.drain_rate.retry_after(max(excess_seqs, 0), max(excess_tokens, 0))
            raise QueueFullError(f"the waiting queue is full ({' and '.join(full)}); retry in "
                                 f"{math.ceil(retry_after)} s", retry_after)

    def observe(self, start: float, end: float, backlog: bool, before: tuple[int, int],
                after: tuple[int, int]) -> None:
        """One engine iteration, as ``DrainRate.observe``."""
        self.drain_rate.observe(start, end, backlog, before, after)


class RequestIds:
    """Every id a request not yet answered holds in the engine, its samples' ids ("<id>-<i>")
    included, so that a caller-chosen id never collides with one of them."""

    def __init__(self) -> None:
        self._in_use: set[str] = set()
        self._ids_of: dict[str, list[str]] = {}

    def reserve(self, request_ids: list[str], n: int) -> None:
        """Take the ids of requests with ``n`` samples each, all or none (InvalidRequestError)."""
        # The engine names a parent's samples "<id>-<i>"; those ids are taken too.
        ids_of = {r: [r] + ([f"{r}-{i}" for i in range(n)] if n > 1 else []) for r in request_ids}
        taken = next((i for ids in ids_of.values() for i in ids if i in self._in_use), None)
        if taken is not None:
            raise InvalidRequestError("request_id", f"request id {taken!r} is already in use",
                                      code="duplicate_request_id")
        for ids in ids_of.values():
            self._in_use.update(ids)
        self._ids_of.update(ids_of)

    def release(self, request_id: str) -> None:
        """The request has been answered: its id and its samples' ids are free again."""
        self._in_use.difference_update(self._ids_of.pop(request_id, ()))
