"""Gray release of a canary arm: who goes where, the SLO watch, promotion and rollback.

    progressing (steps[i] % of tenants on the canary)
        | held hold_s, no rule in breach, >= min_requests_per_step canary requests -> i + 1
        | at 100% and held again                                                    -> promoted
        | a rule in breach for its for_s                                            -> rolled_back (0%)
    off: no canary deployed.  restart(spec) starts over from the first step.

A tenant's arm is a stable hash of its name into 10,000 buckets: the canary takes the buckets
below ``percent * 100``, so raising the percent only adds tenants to the canary and a tenant
never flips between arms while the percent holds. Requests without a tenant are spread by
request id.

Rules are checked every ``evaluation_interval_s``; a breach first seen at time t is checked
again at exactly t + for_s, so a breach is acted on within for_s plus one evaluation interval
of the window's value crossing the limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable

from deepbatch.serve_ray.rollout_spec import RolloutSpec, SLORule

logger = logging.getLogger("deepbatch.rollout")

STABLE = "stable"
CANARY = "canary"
ARMS = (STABLE, CANARY)
BUCKETS = 10_000
_KINDS = ("error", "ttft", "tpot", "e2e")


def tenant_bucket(key: str) -> int:
    """A bucket in [0, BUCKETS) that is the same in every process and release (unlike hash())."""
    digest = hashlib.blake2b(key.encode("utf-8", "backslashreplace"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of unsorted ``values`` (non-empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class ArmWindow:
    """One arm's samples of the last ``window_s`` seconds: an outcome (1 = error) per finished
    attempt, and TTFT, TPOT and end-to-end latency in seconds."""

    def __init__(self):
        self._samples: dict[str, deque[tuple[float, float]]] = {k: deque() for k in _KINDS}

    def add(self, kind: str, now: float, value: float) -> None:
        self._samples[kind].append((now, value))

    def prune(self, now: float, window_s: float) -> None:
        oldest = now - window_s
        for samples in self._samples.values():
            while samples and samples[0][0] < oldest:
                samples.popleft()

    def clear(self) -> None:
        for samples in self._samples.values():
            samples.clear()

    def count(self, kind: str) -> int:
        return len(self._samples[kind])

    def value(self, rule: SLORule) -> float | None:
        values = [v for _, v in self._samples[rule.kind]]
        if not values:
            return None
        if rule.quantile is None:
            return sum(values) / len(values)
        return 1000.0 * quantile(values, rule.quantile)

    def summary(self, spec: RolloutSpec) -> dict:
        out = {"requests": self.count("error"), "errors": int(sum(v for _, v in self._samples["error"]))}
        for rule in spec.slo:
            out[rule.metric] = self.value(rule)
        return out


class RolloutController:
    def __init__(self, spec: RolloutSpec, has_canary: bool, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.clock = clock
        self.wall_clock = wall_clock
        self.has_canary = has_canary
        self.windows = {arm: ArmWindow() for arm in ARMS}
        self.num_rollbacks = 0
        self.num_promotions = 0
        self.history: list[dict] = []
        self._on_rollback: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None
        self.restart(spec, reason="deployed")

    # -- routing ----------------------------------------------------------------------------

    @property
    def canary_percent(self) -> float:
        if self.state in ("progressing", "promoted"):
            return self.spec.steps[self.step]
        return 0.0

    def arm_for(self, key: str) -> str:
        percent = self.canary_percent
        if percent <= 0:
            return STABLE
        return CANARY if tenant_bucket(key) < percent * (BUCKETS // 100) else STABLE

    def add_rollback_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs right after a rollback (on the caller's thread)."""
        self._on_rollback.append(callback)

    # -- samples ----------------------------------------------------------------------------

    def record_ttft(self, arm: str, seconds: float) -> None:
        self.windows[arm].add("ttft", self.clock(), seconds)

    def record_outcome(self, arm: str, error: bool, e2e: float | None = None, tpot: float | None = None) -> None:
        """A finished attempt: an error, or a reply with its latencies."""
        now = self.clock()
        window = self.windows[arm]
        window.add("error", now, 1.0 if error else 0.0)
        if e2e is not None:
            window.add("e2e", now, e2e)
        if tpot is not None:
            window.add("tpot", now, tpot)
        if arm == CANARY and self.state == "progressing":
            self._step_requests += 1

    # -- decisions --------------------------------------------------------------------------

    def restart(self, spec: RolloutSpec, reason: str = "restarted") -> None:
        """Start a rollout from its first step, judging the canary afresh."""
        self.spec = spec
        self.step = 0
        self.state = "progressing" if self.has_canary else "off"
        self._breach_since: dict[str, float] = {}
        self._breach_value: dict[str, float] = {}
        self.windows[CANARY].clear()
        now = self.clock()
        self._step_started = now
        self._step_requests = 0
        self._last_evaluation = now
        self._record("start" if self.has_canary else "off", reason)
        self._poke()

    def rollback(self, reason: str) -> None:
        if self.state not in ("progressing", "promoted"):
            return
        self.state = "rolled_back"
        self._breach_since.clear()
        self.num_rollbacks += 1
        self._record("rollback", reason)
        logger.warning("rollout: canary rolled back to 0%%: %s", reason)
        for callback in self._on_rollback:
            try:
                callback()
            except Exception:  # a listener must not stop the decision
                logger.exception("rollback listener failed")

    def evaluate(self) -> None:
        """Check the rules over the window; roll back, promote or wait."""
        now = self.clock()
        self._last_evaluation = now
        for window in self.windows.values():
            window.prune(now, self.spec.window_s)
        if self.state != "progressing":
            return
        canary = self.windows[CANARY]
        for rule in self.spec.slo:
            if canary.count(rule.kind) < self.spec.min_samples:
                value = None
            else:
                value = canary.value(rule)
            if value is None or value <= rule.max:
                self._breach_since.pop(rule.metric, None)
                self._breach_value.pop(rule.metric, None)
                continue
            since = self._breach_since.setdefault(rule.metric, now)
            self._breach_value[rule.metric] = value
            if now - since >= rule.for_s:
                samples = canary.count(rule.kind)
                self.rollback(f"{rule.metric} = {value:.4g} above {rule.max:g} for {now - since:.1f} s "
                              f"(limit {rule.for_s:g} s; {samples} samples in {self.spec.window_s:g} s)")
                return
        held = now - self._step_started >= self.spec.hold_s
        if self._breach_since or not held or self._step_requests < self.spec.min_requests_per_step:
            return
        if self.step == len(self.spec.steps) - 1:
            self.state = "promoted"
            self._record("promoted", f"held {self.spec.hold_s:g} s at 100% within the SLO")
            logger.info("rollout: canary promoted")
            return
        self.step += 1
        self.num_promotions += 1
        self._step_started = now
        self._step_requests = 0
        self._record("promote", f"held {self.spec.hold_s:g} s within the SLO")
        logger.info("rollout: canary promoted to %g%%", self.canary_percent)

    def seconds_to_next_evaluation(self) -> float:
        now = self.clock()
        due = self._last_evaluation + self.spec.evaluation_interval_s
        for metric, since in self._breach_since.items():
            rule = next(r for r in self.spec.slo if r.metric == metric)
            due = min(due, since + rule.for_s)
        return max(0.0, due - now)

    async def watch(self) -> None:
        """Evaluate on schedule until cancelled (a rollout restarted mid-sleep wakes it)."""
        self._wake = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.seconds_to_next_evaluation())
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                self.evaluate()
            except Exception:  # the watch must outlive a bug in one evaluation
                logger.exception("rollout evaluation failed")

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- reporting --------------------------------------------------------------------------

    def _record(self, action: str, reason: str) -> None:
        self.history.append({"time": self.wall_clock(), "action": action, "canary_percent": self.canary_percent,
                             "step": self.step, "reason": reason})
        del self.history[:-100]  # a bounded log; the counters keep the totals

    def report(self) -> dict:
        now = self.clock()
        for window in self.windows.values():
            window.prune(now, self.spec.window_s)
        return {
            "state": self.state,
            "canary_percent": self.canary_percent,
            "step": self.step,
            "step_held_s": now - self._step_started,
            "step_requests": self._step_requests,
            "rollbacks": self.num_rollbacks,
            "promotions": self.num_promotions,
            "breaches": {m: {"value": self._breach_value.get(m), "for_s": now - since}
                         for m, since in self._breach_since.items()},
            "arms": {arm: self.windows[arm].summary(self.spec) for arm in ARMS},
            "spec": self.spec.as_dict(),
            "history": list(self.history),
        }
