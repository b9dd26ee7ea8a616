"""A simulated runner for SLO tests: the real Scheduler on a fake clock, with a step-time model
instead of a model. Deterministic: arrivals come from a seeded generator, and every step advances
the clock by ``StepModel.duration`` of its shape.

    clock = 0
    loop: add the requests that have arrived; schedule; clock += a + b*tokens + c*seqs;
          update; stamp first-token / last-token times; feed the controller (if any)
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler
from tests.scheduler.commit import commit_step

_ids = itertools.count()


@dataclass(frozen=True)
class StepModel:
    """Seconds per step: ``a + b * batched_tokens + c * seqs``."""

    a: float = 2e-3
    b: float = 0.05e-3
    c: float = 0.02e-3

    def duration(self, tokens: int, seqs: int) -> float:
        return self.a + self.b * tokens + self.c * seqs


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt_len: int
    output_len: int


def poisson_arrivals(rate: float, duration: float, prompt_len: tuple[int, int], output_len: tuple[int, int],
                     seed: int = 0, long_every: float | None = None, long_len: int = 0) -> list[Arrival]:
    """Poisson arrivals at ``rate``/s for ``duration`` s with uniform lengths; with
    ``long_every``, one extra prompt of ``long_len`` tokens every that many seconds (its output
    is drawn like the others)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        out.append(Arrival(t, rng.randint(*prompt_len), rng.randint(*output_len)))
    if long_every:
        k = 1
        while k * long_every < duration:
            out.append(Arrival(k * long_every, long_len, rng.randint(*output_len)))
            k += 1
    return sorted(out, key=lambda a: a.time)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class SimResult:
    requests: list[Request]
    duration: float  # from the first arrival to the last finish
    num_steps: int
    settings: list[tuple[float, int, int]] = field(default_factory=list)  # (time, seqs, tokens) after each step
    step_log: list[tuple[int, int, float]] = field(default_factory=list)  # (tokens, seqs, seconds)

    def ttfts(self, since: float = 0.0) -> list[float]:
        return [r.first_token_time - r.arrival_time for r in self.requests
                if r.first_token_time is not None and r.arrival_time >= since]

    def tpots(self, since: float = 0.0) -> list[float]:
        return [tpot(r) for r in self.requests if r.arrival_time >= since and tpot(r) is not None]

    def goodput(self, ttft_s: float, tpot_s: float) -> float:
        """Requests that finished meeting both targets, per second of the run."""
        good = sum(1 for r in self.requests if r.is_finished and r.first_token_time is not None
                   and r.first_token_time - r.arrival_time <= ttft_s and (tpot(r) or 0.0) <= tpot_s)
        return good / self.duration

    def changes(self, since: float = 0.0) -> int:
        """Setting changes after time ``since``."""
        return sum(1 for x, y in zip(self.settings, self.settings[1:]) if y[0] >= since and x[1:] != y[1:])

    def throughput(self) -> float:
        return sum(1 for r in self.requests if r.is_finished) / self.duration


def tpot(r: Request) -> float | None:
    if r.num_output_tokens < 2 or r.last_token_time is None or r.first_token_time is None:
        return None
    return (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)


def p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else 0.0


def make_scheduler(max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, num_blocks: int = 8192,
                   block_size: int = 16) -> tuple[Scheduler, Clock]:
    clock = Clock()
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, enable_caching=False), 1 << 20, clock=clock), clock


def simulate(arrivals: list[Arrival], sched: Scheduler, clock: Clock, model: StepModel = StepModel(),
             controller=None, max_time: float = 1e9) -> SimResult:
    """Run every arrival to completion (or until ``max_time``) on ``sched``."""
    requests: list[Request] = []
    pending = list(reversed(arrivals))
    steps = 0
    settings, step_log = [], []
    while (pending or sched.has_unfinished()) and clock.t < max_time:
        while pending and pending[-1].time <= clock.t:
            a = pending.pop()
            n = next(_ids)
            r = Request(f"s{n}", [n % 30000 + 10] * a.prompt_len, SamplingParams(max_tokens=a.output_len, ignore_eos=True),
                        a.output_len, arrival_time=a.time)
            requests.append(r)
            sched.add_request(r)
        if not sched.has_unfinished():
            clock.t = pending[-1].time
            continue
        out = sched.schedule()
        if out.is_empty:
            clock.t = pending[-1].time if pending else clock.t + 1e-3
            continue
        tokens, seqs = out.num_scheduled_tokens, len(out.scheduled)
        dt = model.duration(tokens, seqs)
        clock.t += dt
        steps += 1
        sampled_reqs = [s.request for s in out.scheduled if s.samples]
        finished = commit_step(sched, out, {r.request_id: 5 for r in sampled_reqs})
        first = []
        for r in sampled_reqs:
            if r.first_token_time is None:
                r.first_token_time = clock.t
                first.append(r)
            r.last_token_time = clock.t
        if controller is not None:
            controller.observe_step(dt, tokens, seqs, first, finished)
        settings.append((clock.t, sched.max_num_seqs, sched.max_num_batched_tokens))
        step_log.append((tokens, seqs, dt))
    start = arrivals[0].time if arrivals else 0.0
    return SimResult(requests, max(clock.t - start, 1e-9), steps, settings, step_log)
