"""The online SLO controller: it sets the scheduler's run-time limits (``max_num_seqs``,
``max_num_batched_tokens``, which also bounds the prefill chunk) to the highest-throughput
setting predicted to meet p99 targets for TTFT and TPOT. It changes limits only; the scheduler's
one token-budget loop is untouched.

    engine.step: schedule -> execute -> update -> controller.observe_step(duration, shape, ...)
                                                        |
        every ``interval_steps`` steps:  fit t = a + b*tokens + c*seqs  (step_time.py)
                                         measure the load (arrivals, lengths, queued tokens)
                                         predict every candidate setting (slo_frontier.py)
                                         correct by observed p99 / predicted p99 (feedback)
                                         move only past the hysteresis margin

Hysteresis: a decision happens at most once every ``interval_steps`` steps. A setting that
violates a target (predicted, or observed) is left for the best-ranked one (meets both targets >
meets TPOT > neither; see ``slo_frontier.rank``). A setting that meets them is left only for one
that meets them with ``margin`` to spare and promises ``margin`` more throughput or capacity: the
band between "meets" and "meets with room" absorbs noise in the measured load. A setting left for
a violation is not taken for comfortable again at the same load for ``2 * window_s``.
Feedback: once ``min_samples`` requests that arrived under the
current setting have their TTFT (or TPOT), the ratio of their observed p99 to the predicted one
is kept for that setting (smoothed, clamped to [0.5, 4]) and scales its predictions from then on,
and by monotonicity those of settings bigger (TPOT) or smaller (TTFT) than it; an observed p99
over a target also counts as a violation of the current setting whatever the model says.

Thread-safety: every method runs on the engine thread. ``report`` is replaced at each decision
by a new read-only mapping of values captured then, so other threads may read the reference.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deepbatch.core.request import Request
from deepbatch.control.slo_frontier import (FrontierPoint, Setting, Workload, candidate_settings, frontier,
                                              predict, rank)
from deepbatch.control.step_time import StepTimeFit

_CORRECTION_RANGE = (0.5, 4.0)


@dataclass(frozen=True)
class ControllerOptions:
    interval_steps: int = 64  # at most one decision per this many steps
    margin: float = 0.1  # relative gain needed to move within a class
    window_s: float = 10.0  # arrivals and latencies older than this are forgotten
    min_samples: int = 20  # finished requests under a setting before its p99 corrects the model
    latency_samples: int = 512  # most recent TTFT/TPOT samples kept


class SLOController:
    def __init__(self, scheduler, ttft_target_s: float | None, tpot_target_s: float | None,
                 options: ControllerOptions = ControllerOptions()):
        """``scheduler`` exposes ``max_num_seqs``/``max_num_batched_tokens`` (set here),
        ``config`` (the maxima), ``clock``, ``waiting`` and ``running``."""
        self.scheduler = scheduler
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.options = options
        cfg = scheduler.config
        self.candidates = candidate_settings(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.fit = StepTimeFit()
        self.coeffs = None
        # Observed / predicted p99 (TTFT, TPOT) of each setting that has run, with when it was
        # measured: the feedback that corrects the model (see ``corrections``).
        self.observed_ratios: dict[Setting, tuple[float, float | None, float | None]] = {}
        # Settings left because they violated a target, as far as their batches reached:
        # (when, arrivals/s then).
        self._left: dict[Setting, tuple[float, float]] = {}
        self.num_changes = 0
        self.num_steps = 0
        self._steps_since_decision = 0
        self._start = scheduler.clock()
        self._changed_at = self._start
        self._used = (0, 0)  # most seqs and tokens one step used since the last change
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (arrival, prompt, max_tokens)
        self._seen: dict[str, float] = {}  # request id -> arrival, for the arrivals window
        # (arrival time, seconds) of recent requests.
        self._ttft: deque[tuple[float, float]] = deque(maxlen=options.latency_samples)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=options.latency_samples)
        self._mean_output: float | None = None
        self.workload: Workload | None = None
        self.points: list[FrontierPoint] = []
        self.report: ControllerReport = self._build_report("waiting for measurements")

    @property
    def setting(self) -> Setting:
        return Setting(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)

    # -- observations (engine thread, after update) --------------------------------------------

    def observe_step(self, duration_s: float, num_batched_tokens: int, num_seqs: int,
                     first_token: list[Request] = (), finished: list[Request] = ()) -> None:
        """One executed step: its wall time and shape; the requests that got their first token
        in it (``first_token_time`` set) and those that finished (``last_token_time`` set)."""
        self.num_steps += 1
        self.fit.observe(num_batched_tokens, num_seqs, duration_s)
        self._used = (max(self._used[0], num_seqs), max(self._used[1], num_batched_tokens))
        now = self.scheduler.clock()
        for r in first_token:
            self._see(r)
            if r.first_token_time is not None:
                self._ttft.append((r.arrival_time, r.first_token_time - r.arrival_time))
        for r in finished:
            n = r.num_output_tokens
            if n >= 2 and r.first_token_time is not None and r.last_token_time is not None:
                self._tpot.append((r.arrival_time, (r.last_token_time - r.first_token_time) / (n - 1)))
            if n >= 1:
                self._mean_output = n if self._mean_output is None else self._mean_output + 0.05 * (n - self._mean_output)
        self._steps_since_decision += 1
        if self._steps_since_decision >= self.options.interval_steps:
            self._steps_since_decision = 0
            self.decide(now)

    def _see(self, r: Request) -> None:
        if r.request_id not in self._seen:
            self._seen[r.request_id] = r.arrival_time
            self._arrivals.append((r.arrival_time, r.num_prompt_tokens, r.max_tokens))

    # -- the decision --------------------------------------------------------------------------

    def decide(self, now: float) -> None:
        """Refit, re-measure, rebuild the frontier and apply the hysteresis rule."""
        sched = self.scheduler
        for r in list(sched.waiting) + list(sched.running):
            self._see(r)
        self._forget(now)
        self.coeffs = self.fit.fit()
        self.workload = self._measure(now)
        if self.coeffs is None or self.workload is None:
            self.report = self._build_report("waiting for measurements")
            return
        self._feedback(now)
        current = self.setting
        settings = self.candidates if current in self.candidates else [*self.candidates, current]
        self.points = frontier(self.coeffs, self.workload, settings, self.ttft_target_s, self.tpot_target_s,
                               self.corrections)
        comfort = 1.0 - self.options.margin
        violated = self._observed_violation()
        best = max(self.points, key=lambda p: self._rank(p, comfort, now, violated))
        here = next(p for p in self.points if p.setting == current)
        reason = "hold"
        if best.setting != current and self._worth_moving(here, best, comfort, now, violated):
            reason = f"move from {current.max_num_seqs}/{current.max_num_batched_tokens}"
            if violated or not here.meets:
                # What the batches actually reached: limits above that did not bind.
                used = Setting(min(current.max_num_seqs, self._used[0]), min(current.max_num_batched_tokens, self._used[1]))
                self._left[used] = (now, self.workload.arrival_rate)
            sched.set_limits(best.setting.max_num_seqs, best.setting.max_num_batched_tokens)
            self.num_changes += 1
            self._changed_at = now
            self._used = (0, 0)
        self.report = self._build_report(reason)

    def _rank(self, p: FrontierPoint, comfort: float, now: float, violated: bool) -> tuple:
        """``rank``, with feedback: the current setting ranks as meeting nothing when its
        observed p99 is over a target (``violated``), whatever the model says; and a setting allowing 80% or more of the batches that a setting left for a
        violation reached (at this load or more, within the last ``2 * window_s``) never counts
        as comfortably feasible: the model already got that region wrong once."""
        r = rank(p, comfort)
        if violated and p.setting == self.setting:
            return (0, *r[1:])
        if r[0] == 3 and self._backed_off(p.setting, now):
            return (2, *r[1:])
        return r

    def _backed_off(self, s: Setting, now: float) -> bool:
        lam = self.workload.arrival_rate if self.workload else 0.0
        for y, (t, lam_then) in self._left.items():
            if (now - t <= 2 * self.options.window_s and lam >= (1.0 - self.options.margin) * lam_then
                    and self._at_least(s, Setting(int(0.8 * y.max_num_seqs), int(0.8 * y.max_num_batched_tokens)))):
                return True
        return False

    def _at_least(self, s: Setting, y: Setting) -> bool:
        """``s`` allows at least the batches ``y`` allows. A budget counts only up to what a step
        can use (the seats' decodes plus two p99 prompts): past that, a bigger budget changes
        nothing, so 256/4096 is as large as 256/8192 for 300-token prompts."""
        spare = 2 * (self.workload.p99_prompt_tokens if self.workload else 0.0)

        def usable(x: Setting) -> float:
            return min(x.max_num_batched_tokens, x.max_num_seqs + spare)

        return s.max_num_seqs >= y.max_num_seqs and usable(s) >= usable(y)

    def _worth_moving(self, here: FrontierPoint, best: FrontierPoint, comfort: float, now: float,
                      violated: bool) -> bool:
        """The hysteresis rule. A setting that violates a target (predicted, or observed on
        requests that arrived under it) is left for any better-ranked one. A setting that meets
        the targets is left only for one comfortably inside them (``comfort`` times the targets)
        that promises ``margin`` more throughput or capacity: the gap between "meets" and
        "comfortably meets" is a dead band, so noise in the measured load cannot flip a setting
        back and forth."""
        r_here, r_best = self._rank(here, comfort, now, violated), self._rank(best, comfort, now, violated)
        gain = any(g > h * (1.0 + self.options.margin) for g, h in zip(r_best[1:], r_here[1:]))
        if here.meets and not violated:
            return r_best[0] == 3 and gain
        return r_best[0] > r_here[0] or (r_best[0] == r_here[0] and gain)

    def _observed_violation(self) -> bool:
        ttft, tpot = self._since_change(self._ttft), self._since_change(self._tpot)
        return ((self.ttft_target_s is not None and ttft is not None and ttft > self.ttft_target_s)
                or (self.tpot_target_s is not None and tpot is not None and tpot > self.tpot_target_s))

    def _since_change(self, samples) -> float | None:
        """p99 over requests that arrived after the last change (they saw only this setting);
        None with fewer than ``min_samples`` of them."""
        vals = sorted(v for arrived, v in samples if arrived >= self._changed_at)
        if len(vals) < self.options.min_samples:
            return None
        return vals[min(len(vals) - 1, int(0.99 * len(vals)))]

    def _forget(self, now: float) -> None:
        horizon = now - self.options.window_s
        while self._arrivals and self._arrivals[0][0] < horizon:
            self._arrivals.popleft()
        if len(self._seen) > 4 * len(self._arrivals) + 1024:
            self._seen = {k: t for k, t in self._seen.items() if t >= horizon}
        for q in (self._ttft, self._tpot):
            while q and q[0][0] < horizon:  # arrival order is close enough to completion order here
                q.popleft()
        self._left = {s: v for s, v in self._left.items() if now - v[0] <= 2 * self.options.window_s}

    def _measure(self, now: float) -> Workload | None:
        horizon = now - self.options.window_s
        # The deque is in the order requests were seen, which is only roughly arrival order.
        arrivals = [a for a in self._arrivals if horizon <= a[0] <= now]
        if not arrivals:
            return None
        span = min(self.options.window_s, now - self._start)
        # Early on the window is short; at least a few steps' worth keeps the rate finite.
        span = max(span, now - min(a[0] for a in arrivals), 1e-3)
        prompts = sorted(a[1] for a in arrivals)
        p99 = prompts[min(len(prompts) - 1, int(0.99 * len(prompts)))]
        out = self._mean_output
        if out is None:  # nothing finished yet: assume requests run to their max_tokens
            out = sum(a[2] for a in arrivals) / len(arrivals)
        sched = self.scheduler
        backlog = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        backlog += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
        # Plan for one standard error above the measured rate (Poisson counts): a dip in the
        # estimate must not, by itself, move the controller to a setting the true load breaks.
        rate = (len(arrivals) + math.sqrt(len(arrivals))) / span
        return Workload(rate, sum(prompts) / len(prompts), float(p99), float(out), backlog)

    def _feedback(self, now: float) -> None:
        """Record observed / predicted p99 under the current setting. Both sides are floored at
        a quarter of the target first: errors far below a target change no decision, and a
        ratio of two tiny numbers must not scale the predictions of settings near it."""
        _, ttft_pred, tpot_pred = predict(self.coeffs, self.workload, self.setting)
        old = self.observed_ratios.get(self.setting)
        ratios = []
        for i, (samples, pred, target) in enumerate(((self._ttft, ttft_pred, self.ttft_target_s),
                                                     (self._tpot, tpot_pred, self.tpot_target_s))):
            observed = self._since_change(samples)
            if observed is None or target is None or not math.isfinite(pred):
                ratios.append(old[1 + i] if old else None)
                continue
            floor = 0.25 * target
            ratio = max(observed, floor) / max(pred, floor)
            if old and old[1 + i] is not None:
                ratio = math.sqrt(old[1 + i] * ratio)  # smoothed: one noisy window moves it halfway
            ratios.append(min(max(ratio, _CORRECTION_RANGE[0]), _CORRECTION_RANGE[1]))
        if ratios != [None, None]:
            self.observed_ratios[self.setting] = (now, *ratios)
        stale = now - 3 * self.options.window_s
        self.observed_ratios = {s: r for s, r in self.observed_ratios.items() if r[0] >= stale}

    def corrections(self, s: Setting) -> tuple[float, float]:
        """(TTFT, TPOT) factors for setting ``s``: its own observed ratios when it has run;
        otherwise what monotonicity carries over from settings that have. A setting with at least
        as many seats and tokens as one whose TPOT came out worse than predicted is at least as
        slow per token; one with at most as many as one whose TTFT came out worse queues at
        least as long. Only pessimistic ratios (> 1) carry over."""
        own = self.observed_ratios.get(s)
        k_ttft = k_tpot = 1.0
        for y, (_, r_ttft, r_tpot) in self.observed_ratios.items():
            bigger, smaller = self._at_least(s, y), self._at_least(y, s)
            if r_tpot is not None and bigger:
                k_tpot = max(k_tpot, r_tpot)
            if r_ttft is not None and smaller:
                k_ttft = max(k_ttft, r_ttft)
        if own is not None:
            k_ttft = own[1] if own[1] is not None else k_ttft
            k_tpot = own[2] if own[2] is not None else k_tpot
        return k_ttft, k_tpot

    # -- what it reports ------------------------------------------------------------------------

    def observed_p99(self) -> tuple[float | None, float | None]:
        """p99 TTFT and TPOT (seconds) over the window, None without samples."""
        def p99(q):
            vals = sorted(v for _, v in q)
            return vals[min(len(vals) - 1, int(0.99 * len(vals)))] if vals else None

        return p99(self._ttft), p99(self._tpot)

    def _build_report(self, reason: str) -> "ControllerReport":
        """What the controller knows now, captured as values that later steps do not change;
        the dict is built when someone reads it (the metrics or HTTP thread), not here between
        two steps."""
        cfg = self.scheduler.config
        s = self.setting
        ttft, tpot = self.observed_p99()
        m, w, points = self.coeffs, self.workload, self.points
        ratios = list(self.observed_ratios.items())
        steps, mixed = len(self.fit.steps), self.fit.num_mixed
        num_ttft, num_tpot = len(self._ttft), len(self._tpot)
        num_changes, num_steps = self.num_changes, self.num_steps
        targets = (self.ttft_target_s, self.tpot_target_s)

        def build() -> dict:
            def ms(x):
                return None if x is None else round(x * 1000.0, 3)

            return {
                "targets": {"ttft_p99_ms": ms(targets[0]), "tpot_p99_ms": ms(targets[1])},
                "settings": {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                             "prefill_chunk_tokens": s.prefill_chunk_tokens},
                "limits": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens},
                "step_time_model": None if m is None else {
                    "a_ms": m.a * 1000.0, "b_ms_per_token": m.b * 1000.0, "c_ms_per_seq": m.c * 1000.0,
                    "steps": steps, "mixed_steps": mixed},
                "workload": None if w is None else {
                    "arrival_rate_rps": w.arrival_rate, "mean_prompt_tokens": w.mean_prompt_tokens,
                    "p99_prompt_tokens": w.p99_prompt_tokens, "mean_output_tokens": w.mean_output_tokens,
                    "backlog_tokens": w.backlog_tokens},
                "observed": {"ttft_p99_ms": ms(ttft), "tpot_p99_ms": ms(tpot),
                             "ttft_samples": num_ttft, "tpot_samples": num_tpot},
                "observed_ratios": [
                    {"max_num_seqs": k.max_num_seqs, "max_num_batched_tokens": k.max_num_batched_tokens,
                     "ttft": r[1], "tpot": r[2]} for k, r in ratios],
                "num_changes": num_changes,
                "num_steps": num_steps,
                "last_decision": reason,
                "frontier": [p.as_dict() for p in points],
            }

        return ControllerReport(build)


class ControllerReport(Mapping):
    """The controller's report as a read-only mapping, built on first read. Each decision makes a
    new one from captured values, so a reader on another thread never sees it change."""

    def __init__(self, build: Callable[[], dict]):
        self._build = build
        self._data: dict | None = None

    def _get(self) -> dict:
        if self._data is None:
            self._data = self._build()  # two threads may both build it: the same dict twice
        return self._data

    def __getitem__(self, key: str):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def as_dict(self) -> dict:
        return self._get()

    def __reduce__(self):
        # Pickled with the engine's snapshot for the API process (engine/core_process.py): it
        # travels as the built dict.
        return _report_of, (self.as_dict(),)


def _report_of(data: dict) -> ControllerReport:
    report = ControllerReport(dict)
    report._data = data
    return report


def make_controller(scheduler) -> SLOController | None:
    """The controller the scheduler's config asks for: None without an SLO target."""
    ttft_ms, tpot_ms = scheduler.config.slo_ttft_ms, scheduler.config.slo_tpot_ms
    if ttft_ms is None and tpot_ms is None:
        return None
    return SLOController(scheduler, None if ttft_ms is None else ttft_ms / 1000.0,
                         None if tpot_ms is None else tpot_ms / 1000.0)
