"""The online serving workloads (docs/benchmarks.md, "Online serving workloads"): what each request
asks for and when it is sent, drawn up front from one seeded generator so a run can be repeated
exactly and a rate sweep sends the same prompts at every rate.

Arrival offsets are seconds from the start of the run; a request is sent at its offset whether or
not earlier requests have finished (open loop), unless a concurrency limit holds it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("random", "random-short", "hol", "tenants", "burst")

# Tenant names sent in the `user` field and the X-Tenant-Id header.
TENANT_HEAVY = "tenant-heavy"
TENANT_LIGHT = "tenant-light"

# Text prompts are made of common English words, each one token (with its leading space) in the
# usual BPE vocabularies, so a prompt of n words is about n tokens without a tokenizer here.
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
          "which but have an they you were her she there been one all we their has would when if "
          "will more no out so said what up its about into than them can only other time new some "
          "could these two may first then do any like my now over such our man me even most made").split()


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. ``prompt_len`` is the number of prompt tokens this side knows of
    (exact for token-id prompts, the word count for text prompts; the server's usage wins)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    arrival_s: float
    group: str = "all"  # what the report breaks results down by: "short"/"long", a tenant
    user: str | None = None  # the tenant, sent as `user` and X-Tenant-Id


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times of ``n`` requests: the first at 0, then gamma-distributed gaps with shape
    ``burstiness`` and mean ``1 / rate`` (burstiness 1 is a Poisson process; below 1 burstier,
    above 1 more regular). An infinite rate sends everything at once."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def random_lengths(n: int, mean_len: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """vLLM's random dataset: lengths uniform over [mean * (1 - r), mean * (1 + r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    lo = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(mean_len * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def make_prompt(length: int, vocab_size: int, prompt_type: str, rng: np.random.Generator) -> list[int] | str:
    if prompt_type == "text":
        return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=length))
    return rng.integers(0, vocab_size, size=length).tolist()


def _random_requests(n: int, input_len: int, output_len: int, range_ratio: float, arrivals: np.ndarray,
                     vocab_size: int, prompt_type: str, rng: np.random.Generator, group: str = "all") -> list[RequestSpec]:
    in_lens = random_lengths(n, input_len, range_ratio, rng)
    out_lens = random_lengths(n, output_len, range_ratio, rng)
    return [RequestSpec(make_prompt(int(li), vocab_size, prompt_type, rng), int(li), int(lo), float(t), group)
            for li, lo, t in zip(in_lens, out_lens, arrivals)]


def build_requests(args, rate: float, max_model_len: int | None = None) -> list[RequestSpec]:
    """Every request of ``args.workload`` at ``rate`` requests/s, sorted by send time.

    The generator is seeded from ``args.seed`` alone and arrivals are drawn first, so two runs
    with the same seed send the same prompts at the same offsets, and runs at different rates
    differ only in the offsets' scale."""
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    arrivals = arrival_offsets(n, rate, args.burstiness, rng)
    vocab, ptype = args.vocab_size, args.prompt_type
    if args.workload == "random":
        reqs = _random_requests(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                arrivals, vocab, ptype, rng)
    elif args.workload == "random-short":
        reqs = _random_requests(n, 1024, 128, 0.0, arrivals, vocab, ptype, rng)
    elif args.workload == "hol":
        reqs = _hol_requests(args, arrivals, max_model_len, rng)
    elif args.workload == "tenants":
        reqs = _tenant_requests(args, arrivals, rng)
    elif args.workload == "burst":
        reqs = _burst_requests(args, rate, arrivals, rng)
    else:
        raise ValueError(f"unknown workload {args.workload!r}")
    return sorted(reqs, key=lambda r: r.arrival_s)


def _hol_requests(args, arrivals: np.ndarray, max_model_len: int | None, rng: np.random.Generator) -> list[RequestSpec]:
    """Short chat-like requests at the run's rate; long prompts every ``hol_long_every`` seconds
    while the short ones are still arriving (at least one, in the middle of the run), so each
    long prefill lands among running short decodes."""
    shorts = _random_requests(len(arrivals), args.hol_short_input_len, args.hol_short_output_len, 0.0, arrivals,
                              args.vocab_size, args.prompt_type, rng, group="short")
    long_len = args.hol_long_len
    if max_model_len:  # a prompt the server must reject would measure nothing
        long_len = min(long_len, max_model_len - args.hol_long_output_len)
    if long_len <= 0:
        raise ValueError(f"--hol-long-len leaves no room under the server's max_model_len {max_model_len}")
    span = float(arrivals[-1]) if len(arrivals) else 0.0
    times = np.arange(args.hol_long_every, span, args.hol_long_every) if args.hol_long_every > 0 else np.zeros(0)
    if len(times) == 0:
        times = np.array([span / 2.0])
    longs = [RequestSpec(make_prompt(long_len, args.vocab_size, args.prompt_type, rng), long_len,
                         args.hol_long_output_len, float(t), "long") for t in times]
    return shorts + longs


def _tenant_requests(args, arrivals: np.ndarray, rng: np.random.Generator) -> list[RequestSpec]:
    """Two tenants over one arrival stream: the heavy one gets ``tenant_ratio`` times the light
    one's requests (exact counts, randomly interleaved), with the same request shape, so the
    heavy tenant offers ``tenant_ratio`` times the load."""
    n = len(arrivals)
    n_heavy = round(n * args.tenant_ratio / (args.tenant_ratio + 1.0))
    labels = np.array([TENANT_HEAVY] * n_heavy + [TENANT_LIGHT] * (n - n_heavy))
    labels = labels[rng.permutation(n)]
    base = _random_requests(n, args.random_input_len, args.random_output_len, args.random_range_ratio, arrivals,
                            args.vocab_size, args.prompt_type, rng)
    return [RequestSpec(r.prompt, r.prompt_len, r.output_len, r.arrival_s, str(t), str(t))
            for r, t in zip(base, labels)]


def burst_offsets(arrivals: np.ndarray, rate: float, start_s: float, duration_s: float, factor: float) -> np.ndarray:
    """``arrivals`` of a process at ``rate`` re-timed so that the rate is ``factor`` times higher
    during ``[start_s, start_s + duration_s)``: each arrival keeps its place in the cumulative
    intensity (``rate * t``, which grows ``factor`` times faster inside the window), so a
    Poisson process stays Poisson with the piecewise rate."""
    if math.isinf(rate):
        return arrivals
    if factor <= 0 or duration_s < 0 or start_s < 0:
        raise ValueError("--burst-factor must be positive, --burst-start-s and --burst-duration-s not negative")
    x = arrivals * rate  # cumulative intensity at each arrival
    x0, x1 = rate * start_s, rate * start_s + factor * rate * duration_s
    return np.where(x < x0, x / rate,
                    np.where(x < x1, start_s + (x - x0) / (factor * rate), start_s + duration_s + (x - x1) / rate))


def _burst_requests(args, rate: float, arrivals: np.ndarray, rng: np.random.Generator) -> list[RequestSpec]:
    """``random`` requests at ``rate``, except ``--burst-factor`` times that rate for
    ``--burst-duration-s`` from ``--burst-start-s`` (the SLO controller's test: a load the
    defaults carry, then a burst they do not). Requests are grouped "steady" and "burst" by
    whether they arrive inside the window."""
    end = args.burst_start_s + args.burst_duration_s
    times = burst_offsets(arrivals, rate, args.burst_start_s, args.burst_duration_s, args.burst_factor)
    base = _random_requests(len(times), args.random_input_len, args.random_output_len, args.random_range_ratio,
                            times, args.vocab_size, args.prompt_type, rng)
    return [RequestSpec(r.prompt, r.prompt_len, r.output_len, r.arrival_s,
                        "burst" if args.burst_start_s <= r.arrival_s < end else "steady") for r in base]

