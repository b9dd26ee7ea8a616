"""Predicted throughput and p99 latency of one scheduler setting, from the fitted step-time model
and the measured workload: the points of the SLO controller's frontier.

A fluid model of the token-budget loop. For a setting (``S = max_num_seqs``,
``B = max_num_batched_tokens``), with ``lam`` arrivals/s, prompts of ``P`` tokens (p99 ``L``),
outputs of ``O`` tokens and ``t(tokens, seqs) = a + b*tokens + c*seqs``:

- capacity: a saturated step runs ``d = min(S, B*O/(P+O))`` decodes and the ``d*P/O`` prefill
  tokens that keep those seats refilled; it finishes ``d/O`` requests in ``t(d + d*P/O, d + 1)``.
- loaded step time: by Little's law ``lam*t*O`` requests decode at once and ``lam*t*(P+O)`` tokens
  run per step, so ``t = (a + c) / (1 - lam*(b*(P+O) + c*O))``, capped at the saturated time.
- TPOT p99: the step time with the p99 number of decodes in it. Concurrency swings around its
  mean ``lam*t*O`` (Poisson-like, widened by ``1/(1 - utilization)`` because a longer step lets
  more arrivals join the next one) up to the seats, and a step never holds more than the budget,
  so both limits cap it. A request whose decode overlaps the prefill of a p99 prompt also sees
  ``ceil(L / chunk)`` full-budget steps (``chunk = B - decodes``) among its ``O`` tokens.
- TTFT p99: the prompt tokens already queued ahead (drained a chunk per full step; counting them
  keeps a burst from shrinking the budget that drains it), plus the p99 wait for a seat (the
  ``S`` seats as servers of an M/G/c queue, each held for ``O`` saturated steps), plus the prefill
  of a p99 prompt. Infinite when ``lam`` reaches the capacity: the queue grows without bound.

The model ignores KV-cache limits and the variance of lengths beyond the p99 prompt; the
controller corrects its latencies with observed p99s (feedback), so it must rank settings
correctly more than it must be exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from deepbatch.control.step_time import StepTimeCoeffs

INF = float("inf")


@dataclass(frozen=True)
class Setting:
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def prefill_chunk_tokens(self) -> int:
        """The longest prefill chunk of one step: the scheduler has no separate chunk limit, so
        the step's budget bounds it."""
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class Workload:
    """What the controller measured over its window."""

    arrival_rate: float  # requests/s
    mean_prompt_tokens: float
    p99_prompt_tokens: float
    mean_output_tokens: float
    backlog_tokens: int  # prompt tokens queued or still to prefill


@dataclass(frozen=True)
class FrontierPoint:
    setting: Setting
    capacity: float  # requests/s when saturated
    throughput: float  # requests/s at the measured load: min(arrivals, capacity)
    ttft_p99_s: float  # corrected by the observed/predicted ratio
    tpot_p99_s: float
    meets_ttft: bool
    meets_tpot: bool

    # Targets, kept so that a point can say how far inside them it is.
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None

    @property
    def meets(self) -> bool:
        return self.meets_ttft and self.meets_tpot

    def within(self, fraction: float) -> bool:
        """Both latencies at most ``fraction`` of their targets."""
        return ((self.ttft_target_s is None or self.ttft_p99_s <= fraction * self.ttft_target_s)
                and (self.tpot_target_s is None or self.tpot_p99_s <= fraction * self.tpot_target_s))

    def as_dict(self) -> dict:
        def ms(x: float) -> float | None:
            return round(x * 1000.0, 3) if math.isfinite(x) else None

        return {"max_num_seqs": self.setting.max_num_seqs,
                "max_num_batched_tokens": self.setting.max_num_batched_tokens,
                "prefill_chunk_tokens": self.setting.prefill_chunk_tokens,
                "throughput_rps": round(self.throughput, 4), "capacity_rps": round(self.capacity, 4),
                "ttft_p99_ms": ms(self.ttft_p99_s), "tpot_p99_ms": ms(self.tpot_p99_s),
                "meets_ttft": self.meets_ttft, "meets_tpot": self.meets_tpot, "meets": self.meets}


def predict(m: StepTimeCoeffs, w: Workload, s: Setting) -> tuple[float, float, float]:
    """(capacity requests/s, TTFT p99 s, TPOT p99 s) of setting ``s``, uncorrected."""
    a, b, c = m.a, m.b, m.c
    lam = max(w.arrival_rate, 0.0)
    P = max(w.mean_prompt_tokens, 1.0)
    L = max(w.p99_prompt_tokens, P)
    O = max(w.mean_output_tokens, 1.0)
    S, B = s.max_num_seqs, s.max_num_batched_tokens

    d = max(1.0, min(S, B * O / (P + O)))
    t_sat = a + b * (d + d * P / O) + c * (d + 1)
    capacity = d / (O * t_sat) if t_sat > 0 else INF

    k = lam * (b * (P + O) + c * O)  # utilization of the fluid model, without the step overhead
    if k >= 1.0:
        return capacity, INF, t_sat
    t_load = min((a + c) / (1.0 - k), t_sat)
    # Decodes in a step: Poisson-like around the mean, and widened by 1/(1-k) because a longer
    # step lets more requests arrive and join it.
    n_mean = lam * O * t_load
    n_p99 = n_mean + 2.33 * math.sqrt(n_mean) / (1.0 - k)
    if n_p99 >= S:
        t_p99 = t_sat  # seats full: every step runs S decodes and the prefill that refills them
    else:
        t_p99 = (a + c + (b + c) * n_p99) / max(1.0 - lam * b * P, 1e-3)
    t_p99 = min(t_p99, a + b * B + c * min(S, B))  # a step never runs more than the budget
    n = min(float(S), n_mean)
    chunk = max(1.0, B - n)
    full_seqs = n + 1
    t_full = a + b * B + c * full_seqs
    lump_steps = math.ceil(L / chunk)
    t_lump = a + b * min(B, n + L) + c * full_seqs
    f = min(1.0, lump_steps / O)
    tpot = max(t_p99, f * t_lump + (1.0 - f) * t_load)

    rho = lam / capacity if capacity > 0 else INF
    if rho >= 1.0:
        return capacity, INF, tpot
    ttft = (w.backlog_tokens / chunk) * t_full + _p99_wait(rho, S, O * t_sat) + lump_steps * t_lump
    return capacity, ttft, tpot


def _p99_wait(rho: float, servers: int, service_s: float) -> float:
    """p99 wait for a seat: ``servers`` seats each held for ``service_s``, at utilization ``rho``.
    Sakasegawa's approximation of the mean wait of an M/G/c queue (service nearly deterministic:
    squared coefficient of variation ~0), times ln(100) for an exponential tail."""
    if rho <= 0.0:
        return 0.0
    c = max(1, servers)
    mean = rho ** (math.sqrt(2.0 * (c + 1)) - 1.0) / (c * (1.0 - rho)) * service_s * 0.5
    return mean * math.log(100.0)


def frontier(m: StepTimeCoeffs, w: Workload, settings: list[Setting], ttft_target_s: float | None,
             tpot_target_s: float | None,
             corrections: Callable[[Setting], tuple[float, float]] = lambda s: (1.0, 1.0)) -> list[FrontierPoint]:
    """One point per setting, in the order given; ``corrections(setting)`` gives the factors
    (TTFT, TPOT) that scale its predicted latencies. A missing target is always met."""
    points = []
    for s in settings:
        capacity, ttft, tpot = predict(m, w, s)
        k_ttft, k_tpot = corrections(s)
        ttft *= k_ttft
        tpot *= k_tpot
        points.append(FrontierPoint(
            s, capacity, min(w.arrival_rate, capacity), ttft, tpot,
            meets_ttft=ttft_target_s is None or ttft <= ttft_target_s,
            meets_tpot=tpot_target_s is None or tpot <= tpot_target_s,
            ttft_target_s=ttft_target_s, tpot_target_s=tpot_target_s))
    return points


def rank(p: FrontierPoint, comfort: float = 1.0) -> tuple:
    """Higher is better. Settings that meet both targets come first (those with latencies under
    ``comfort`` times the targets before those just under them), by throughput at this load and
    then by capacity (headroom for the next burst). With none feasible, keeping TPOT comes next
    (the running requests keep their token rate), then capacity: the setting that drains the
    queue fastest, never the smallest one, so infeasible targets do not cost throughput."""
    if p.meets:
        return (3 if p.within(comfort) else 2, p.throughput, p.capacity)
    return (1 if p.meets_tpot else 0, p.capacity, 0.0)


def candidate_settings(max_num_seqs: int, max_num_batched_tokens: int, min_num_seqs: int = 4,
                       min_batched_tokens: int = 64) -> list[Setting]:
    """A geometric grid under the configured maxima (which sized memory and CUDA graphs, so the
    controller never goes above them): seats in steps of 2**(1/4), budgets in steps of 2, and
    budgets no smaller than the seats (a budget under the seat count leaves seats idle)."""
    seqs = _geometric(max_num_seqs, min(min_num_seqs, max_num_seqs), 2.0 ** 0.25)
    tokens = _geometric(max_num_batched_tokens, min(min_batched_tokens, max_num_batched_tokens), 2.0)
    return [Setting(s, t) for s in seqs for t in tokens if t >= s or t == max_num_batched_tokens]


def _geometric(top: int, bottom: int, ratio: float) -> list[int]:
    out, x = [], float(top)
    while round(x) >= bottom:
        if not out or round(x) != out[-1]:
            out.append(round(x))
        x /= ratio
    return out
