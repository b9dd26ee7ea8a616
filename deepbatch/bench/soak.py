"""``python -m deepbatch.bench.soak``: a long open-loop load on a live server that checks the server
stays healthy under overload, client disconnects and hostile bodies.

    python -m deepbatch.bench.soak --url http://127.0.0.1:8000 --server-pid PID --duration-s 1200 \\
        --find-saturation --rate-multiplier 1.5 --disconnect-fraction 0.1 --hostile-fraction 0.02 \\
        --workload random-short --out soak.json

Phases:
1. saturation (``--find-saturation``, or when neither --rate nor --saturation-rate is given):
   one request runs to its end alone (the server warmed up), then closed-loop clients keep
   ``--saturation-concurrency`` requests in flight for ``--saturation-s``; completed requests per
   second after the first quarter is the saturation rate S;
2. soak: Poisson arrivals at --rate (else ``--rate-multiplier`` x S) for --duration-s. Each arrival
   is, by draw, a hostile body, a stream the client closes after a random number of chunks, a
   non-streaming request or a plain stream. The server's /stats gauges, /metrics, and its host RSS
   (/proc/PID/status) are sampled every --sample-interval-s;
3. end: wait for the server to go idle and read its KV usage.

Every request ends in exactly one outcome (OUTCOMES). 429 and 4xx are clean rejections. "lost" is a
request the server never ended: a stream that stopped with neither a finish_reason nor an error
event while the client kept listening, a non-streaming 200 without a finished choice, or no answer
at all once connected (timeouts included). The load runs in --num-clients processes: one Python
event loop parsing every token chunk falls behind a GPU server before the server saturates.

This module is the command line; the parts are ``soak_client`` (the jobs sent and how one
request's end is classified), ``soak_phases`` (the load processes, the phases and the server's
gauges) and ``soak_report`` (the result, the memory flatness and the verdict).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

from deepbatch.bench import serve
from deepbatch.bench.serve_workloads import WORKLOADS
from deepbatch.bench.soak_client import KINDS, OUTCOMES, Job, discover_model, hostile_bodies, send
from deepbatch.bench.soak_phases import find_saturation, raise_fd_limit, run_phase
from deepbatch.bench.soak_report import config, flatness, format_report, summarize

# The names of the parts that callers use, reachable from the tool's entry point.
__all__ = ["KINDS", "OUTCOMES", "Job", "add_arguments", "flatness", "format_report", "hostile_bodies", "main", "run",
           "send", "summarize"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name to send; default: the first of GET /v1/models")
    p.add_argument("--server-pid", type=int, default=None, help="the server's process id, for its host RSS")
    p.add_argument("--duration-s", type=float, default=1200.0, help="seconds of load (0: the saturation phase only)")
    p.add_argument("--rate", type=float, default=None, help="requests/s of the soak")
    p.add_argument("--rate-multiplier", type=float, default=1.5, help="soak rate / saturation rate")
    p.add_argument("--saturation-rate", type=float, default=None, help="a known saturation rate (skips the phase)")
    p.add_argument("--find-saturation", action="store_true", help="measure the saturation rate first")
    p.add_argument("--saturation-s", type=float, default=60.0)
    p.add_argument("--saturation-concurrency", type=int, default=256, help="requests in flight while measuring it")
    p.add_argument("--disconnect-fraction", type=float, default=0.1)
    p.add_argument("--hostile-fraction", type=float, default=0.02)
    p.add_argument("--non-stream-fraction", type=float, default=0.05)
    p.add_argument("--sampling", choices=("mixed", "greedy"), default="mixed",
                   help="mixed: a third each of greedy, seeded and top-p/top-k sampling")
    p.add_argument("--workload", choices=WORKLOADS, default="random-short")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are uniform in [0, N)")
    p.add_argument("--prompt-type", choices=("ids", "text"), default="ids")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take, end to end")
    p.add_argument("--num-clients", type=int, default=1, help="load generator processes")
    p.add_argument("--sample-interval-s", type=float, default=5.0)
    p.add_argument("--progress-interval-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=120.0, help="memory samples before this are not judged")
    p.add_argument("--window-s", type=float, default=300.0, help="the first and last memory windows compared")
    p.add_argument("--flat-tolerance", type=float, default=0.05, help="largest relative memory change called flat")
    p.add_argument("--flat-tolerance-mib", type=float, default=512.0, help="largest memory change called flat")
    p.add_argument("--min-rise-mib", type=float, default=8.0,
                   help="steady growth smaller than this over the judged span is not called growth")
    p.add_argument("--idle-timeout-s", type=float, default=180.0, help="wait for the server to go idle at the end")
    p.add_argument("--out", default=None, help="the result JSON")
    p.add_argument("--requests-out", default=None, help="every request's record, JSON lines (.gz: gzipped)")


def _check(args) -> None:
    fractions = (args.disconnect_fraction, args.hostile_fraction, args.non_stream_fraction)
    if any(not 0.0 <= f <= 1.0 for f in fractions) or sum(fractions) > 1.0:
        raise ValueError("the disconnect, hostile and non-stream fractions must be in [0, 1] and sum to at most 1")
    if args.duration_s < 0 or args.saturation_s <= 0 or args.timeout <= 0:
        raise ValueError("--duration-s must be >= 0, --saturation-s and --timeout > 0")
    if args.num_clients < 1 or args.saturation_concurrency < args.num_clients:
        raise ValueError("--num-clients must be >= 1 and <= --saturation-concurrency")
    for name in ("rate", "saturation_rate"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")


def run(args: argparse.Namespace) -> dict:
    """The saturation phase (if asked or needed), the soak, the report; writes --out and
    --requests-out and returns the result."""
    _check(args)
    defaults = argparse.ArgumentParser()
    serve.add_arguments(defaults)  # the workload fields this tool has no flags for (hol, tenants)
    for k, v in vars(defaults.parse_args([])).items():
        if not hasattr(args, k):
            setattr(args, k, v)
    raise_fd_limit()
    model, max_model_len = discover_model(args)
    args.model = model
    saturation = None
    if args.find_saturation or (args.rate is None and args.saturation_rate is None):
        saturation = find_saturation(args, model, max_model_len)
    elif args.saturation_rate is not None:
        saturation = {"rate": args.saturation_rate, "given": True}
    rate = args.rate if args.rate is not None else args.rate_multiplier * saturation["rate"]
    if args.duration_s == 0:
        result = {"config": config(args), "saturation": saturation}
    else:
        if not rate > 0:
            raise ValueError("the soak rate came out as 0: the server completed nothing while saturated")
        print(f"soak: {args.duration_s:g} s at {rate:.2f} req/s, {args.num_clients} client process(es)", flush=True)
        soak = run_phase("soak", args, model, max_model_len, rate)
        result = summarize(args, soak, rate, saturation)
        print(format_report(result), flush=True)
        if args.requests_out:
            opener = gzip.open if args.requests_out.endswith(".gz") else open
            with opener(args.requests_out, "wt") as f:
                for rec in (r for res in soak["results"] for r in res):
                    f.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deepbatch.bench.soak", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        result = run(args)
    except ValueError as e:
        print(f"soak: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if result.get("verdict", {"passed": True})["passed"] else 1)


if __name__ == "__main__":
    main()
