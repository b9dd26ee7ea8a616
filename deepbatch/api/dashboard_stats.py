"""Request-level numbers for the dashboard that the engine snapshot does not hold: TTFT and TPOT
percentiles and each tenant's share of the generated tokens, over a sliding window.

An engine output observer (engine thread) records one TTFT per request when its first token is
out and one TPOT per request when it finishes, and adds every generated token to its tenant's
per-second bucket; ``report`` (event-loop thread) reads them under a lock. Definitions match
``deepbatch bench serve`` and the SLO controller, so the three can be compared:

- TTFT: arrival to first token;
- TPOT: (finish - first token) / (output tokens - 1), the mean decode time per token after the
  first, for requests that finished by stop or length with at least two tokens (the longest
  choice counts when ``n > 1``: the request is done when its last choice is).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from deepbatch.core.outputs import RequestOutput

WINDOW_S = 60.0
# Samples kept per series whatever the traffic, so a burst cannot grow the window's memory.
MAX_SAMPLES = 20_000
# Tenants come from a client-chosen field: past this many names, new ones count as "other".
MAX_TENANTS = 100
OTHER_TENANT = "other"


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks, as
    ``numpy.percentile`` computes it by default (``deepbatch bench serve`` reports those)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class DashboardStats:
    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (when observed, seconds)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        # (whole second, {tenant: tokens generated in it}), oldest first.
        self._tokens: deque[tuple[int, dict[str, int]]] = deque()
        self._tenants: set[str] = set()
        self._seen: dict[str, int] = {}  # request id -> output tokens counted so far
        self.num_finished = 0

    def _tenant(self, name: str) -> str:
        if name in self._tenants or len(self._tenants) < MAX_TENANTS:
            self._tenants.add(name)
            return name
        return OTHER_TENANT

    def observe(self, outputs: Iterable[RequestOutput]) -> None:
        """Engine output observer: runs on the engine thread after each iteration."""
        now = self.clock()
        with self._lock:
            for out in outputs:
                self._observe_one(out, now)
            self._forget(now)

    def _observe_one(self, out: RequestOutput, now: float) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        before = self._seen.get(out.request_id, 0)
        m = out.metrics
        if tokens > before:
            if before == 0 and m is not None and m.first_token_time is not None:
                self._ttft.append((now, max(m.first_token_time - m.arrival_time, 0.0)))
            second = int(now)
            if not self._tokens or self._tokens[-1][0] != second:
                self._tokens.append((second, {}))
            bucket = self._tokens[-1][1]
            tenant = self._tenant(out.tenant)
            bucket[tenant] = bucket.get(tenant, 0) + tokens - before
        if not out.finished:
            self._seen[out.request_id] = max(tokens, before)
            return
        self._seen.pop(out.request_id, None)
        self.num_finished += 1
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        completed = out.error is None and all(c.finish_reason in ("stop", "length") for c in out.outputs)
        if (completed and longest >= 2 and m is not None and m.first_token_time is not None
                and m.finished_time is not None):
            self._tpot.append((now, max(m.finished_time - m.first_token_time, 0.0) / (longest - 1)))

    def _forget(self, now: float) -> None:
        horizon = now - self.window_s
        for q in (self._ttft, self._tpot):
            while q and q[0][0] < horizon:
                q.popleft()
        # A bucket stays while any part of its second is inside the window.
        while self._tokens and self._tokens[0][0] + 1 <= horizon:
            self._tokens.popleft()

    def report(self) -> dict:
        """TTFT and TPOT p50/p99 in milliseconds (None without samples) and the tenants' token
        shares, all over the last ``window_s`` seconds."""
        with self._lock:
            self._forget(self.clock())
            ttft = sorted(v for _, v in self._ttft)
            tpot = sorted(v for _, v in self._tpot)
            per_tenant: dict[str, int] = {}
            for _, bucket in self._tokens:
                for tenant, n in bucket.items():
                    per_tenant[tenant] = per_tenant.get(tenant, 0) + n
            finished = self.num_finished
        total = sum(per_tenant.values())
        tenants = [{"tenant": t, "generation_tokens": n, "share": n / total}
                   for t, n in sorted(per_tenant.items(), key=lambda kv: (-kv[1], kv[0]))]
        return {"window_s": self.window_s, "ttft_ms": _summary(ttft), "tpot_ms": _summary(tpot),
                "tenants": tenants, "num_requests_finished": finished}


def _summary(sorted_s: list[float]) -> dict:
    if not sorted_s:
        return {"p50": None, "p99": None, "samples": 0}
    return {"p50": 1000.0 * percentile(sorted_s, 50), "p99": 1000.0 * percentile(sorted_s, 99),
            "samples": len(sorted_s)}
