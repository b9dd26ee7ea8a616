"""The ingress's Prometheus metrics: per arm (label ``arm``: stable | canary) and the rollout's.

Per arm, every attempt counts where it ran: a request that failed on the canary before
streaming and then succeeded on stable is a canary error and a stable request, while its
client saw one reply. Latencies use vLLM's buckets, so dashboards built for vLLM read the same;
TPOT is (e2e - TTFT) / (output tokens - 1), for replies of two tokens or more.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepbatch.api.metrics import _ITL_BUCKETS, _LATENCY_BUCKETS, _TTFT_BUCKETS
from deepbatch.serve_ray.client import ArmObserver
from deepbatch.serve_ray.rollout import ARMS, RolloutController

_STATES = ("off", "progressing", "promoted", "rolled_back")


class _RolloutCollector:
    def __init__(self, rollout: RolloutController):
        self.rollout = rollout

    def collect(self):
        r = self.rollout
        percent = GaugeMetricFamily("deepbatch:rollout_canary_percent", "Percent of tenants routed to the canary arm.")
        percent.add_metric([], r.canary_percent)
        yield percent
        rollbacks = CounterMetricFamily("deepbatch:rollout_rollbacks", "Rollbacks of the canary to 0% on an SLO breach "
                                        "(or by hand).")
        rollbacks.add_metric([], r.num_rollbacks)
        yield rollbacks
        promotions = CounterMetricFamily("deepbatch:rollout_promotions", "Promotions of the canary to its next step.")
        promotions.add_metric([], r.num_promotions)
        yield promotions
        state = GaugeMetricFamily("deepbatch:rollout_state", "1 for the rollout's current state.", labels=["state"])
        for name in _STATES:
            state.add_metric([name], 1.0 if r.state == name else 0.0)
        yield state


class ArmMetrics(ArmObserver):
    """Counts and times attempts per arm, and feeds the same samples to the rollout's watch."""

    def __init__(self, rollout: RolloutController):
        self.rollout = rollout
        self.registry = reg = CollectorRegistry()
        labels = ["arm"]
        self.requests = Counter("deepbatch:arm_requests", "Attempts finished on each arm (replies and errors).", labels,
                                registry=reg)
        self.errors = Counter("deepbatch:arm_request_errors", "Attempts that failed on each arm (a replica's fault, "
                              "not the client's).", labels, registry=reg)
        self.retries = Counter("deepbatch:arm_retries", "Attempts that failed before streaming and were sent to the "
                               "stable arm again.", labels, registry=reg)
        self.moved_requests = Counter("deepbatch:rollout_moved_requests", "Canary requests not yet streaming that a "
                                      "rollback moved to the stable arm.", registry=reg)
        self.ttft = Histogram("deepbatch:arm_time_to_first_token_seconds", "Time to first token per arm.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("deepbatch:arm_time_per_output_token_seconds", "Time per output token after the first, "
                              "per arm.", labels, buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("deepbatch:arm_e2e_request_latency_seconds", "End-to-end latency of an attempt per arm.",
                             labels, buckets=_LATENCY_BUCKETS, registry=reg)
        for arm in ARMS:  # both arms are listed from the start, at 0
            for metric in (self.requests, self.errors, self.retries, self.ttft, self.tpot, self.e2e):
                metric.labels(arm)
        reg.register(_RolloutCollector(rollout))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def first_token(self, arm: str, ttft: float) -> None:
        self.ttft.labels(arm).observe(ttft)
        self.rollout.record_ttft(arm, ttft)

    def finished(self, arm: str, error: bool, e2e: float | None = None, tpot: float | None = None) -> None:
        self.requests.labels(arm).inc()
        if error:
            self.errors.labels(arm).inc()
        if e2e is not None:
            self.e2e.labels(arm).observe(e2e)
        if tpot is not None:
            self.tpot.labels(arm).observe(tpot)
        self.rollout.record_outcome(arm, error, e2e, tpot)

    def retried(self, arm: str) -> None:
        self.retries.labels(arm).inc()

    def moved(self) -> None:
        self.moved_requests.inc()
