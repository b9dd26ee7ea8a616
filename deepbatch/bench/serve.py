"""``deepbatch bench serve``: an open-loop load generator for an OpenAI-compatible server.

It sends streaming ``/v1/completions`` requests (token-id prompts, EOS ignored, fixed
``max_tokens``) on a seeded Poisson (or gamma) arrival schedule or at a fixed concurrency, times
every chunk, and prints the block ``vllm bench serve`` prints, so the two read side by side.

    python -m deepbatch.bench.serve --workload random-short --request-rate 8 --num-prompts 500 \
        --goodput ttft:500 tpot:50 --output-json out.json     # plots in out.png (serve_plots.py)
    python -m deepbatch.bench.serve --workload random-short --sweep-rates 1,2,4,8,16 --plot sweep.png
    python -m deepbatch.bench.serve --workload hol --request-rate 4 --hol-long-every 5
    python -m deepbatch.bench.serve --workload tenants --request-rate 10 --num-prompts 550
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime, timezone

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]

from deepbatch.bench import serve_plots
from deepbatch.bench.serve_clients import run_sharded
from deepbatch.bench.serve_metrics import (format_report, format_sweep, parse_goodput, per_request,
                                           plot_sweep, summarize)
from deepbatch.bench.serve_requests import auth_headers, make_client, run_requests, send_request
from deepbatch.bench.serve_workloads import WORKLOADS, build_requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", default=None, help="model name to send; default: the first of GET /v1/models")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s of the arrival process; inf sends every request at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps: 1 is Poisson, <1 burstier, >1 more regular")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most N requests in flight")
    p.add_argument("--num-client-processes", type=int, default=1,
                   help="send from N processes (requests dealt round-robin, one start instant; each holds "
                        "max-concurrency / N): for loads one process cannot parse fast enough")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take, end to end")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent one by one before the timed run")
    p.add_argument("--prompt-type", choices=("ids", "text"), default="ids",
                   help="prompts as token-id lists (exact lengths) or as text of common words")
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are uniform in [0, N)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L * (1 - r), L * (1 + r)]")
    p.add_argument("--hol-short-input-len", type=int, default=128)
    p.add_argument("--hol-short-output-len", type=int, default=64)
    p.add_argument("--hol-long-len", type=int, default=32768,
                   help="long prompt tokens (capped by the server's max_model_len when it reports one)")
    p.add_argument("--hol-long-output-len", type=int, default=16)
    p.add_argument("--hol-long-every", type=float, default=5.0, help="seconds between long prompts")
    p.add_argument("--burst-start-s", type=float, default=30.0, help="burst: when the rate goes up")
    p.add_argument("--burst-duration-s", type=float, default=30.0, help="burst: for how long")
    p.add_argument("--burst-factor", type=float, default=2.0, help="burst: the rate's multiple inside the window")
    p.add_argument("--tenant-ratio", type=float, default=10.0, help="heavy tenant's load / light tenant's load")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs per request, e.g. ttft:500 tpot:50 e2el:10000; goodput counts requests meeting all")
    p.add_argument("--sweep-rates", default=None, help="comma list of rates, e.g. 1,2,4,8; overrides --request-rate")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="with --sweep-rates: goodput and p99 vs rate")
    p.add_argument("--output-json", default=None,
                   help="write the results here, and their latency/throughput plots beside them (X.json -> X.png)")
    p.add_argument("--no-plots", action="store_true", help="do not write the plots beside --output-json")
    p.add_argument("--label", default=None,
                   help="names this run in the JSON (e.g. the server's settings), for serve_compare")
    p.add_argument("--disable-tqdm", action="store_true")


async def _discover(client: httpx.AsyncClient, args) -> tuple[str, int | None]:
    """The model to name in requests and the server's max_model_len (None when not reported)."""
    try:
        resp = await client.get("/v1/models", headers=auth_headers(args.api_key))
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        if args.model:
            return args.model, None
        raise ValueError(f"cannot list models at {args.base_url}/v1/models ({e}); pass --model") from None
    card = next((c for c in cards if c.get("id") == args.model), None) if args.model else (cards[0] if cards else None)
    if card is None and not args.model:
        raise ValueError(f"{args.base_url}/v1/models lists no model; pass --model")
    model = args.model or card["id"]
    return model, (card or {}).get("max_model_len")


async def _controller_report(client: httpx.AsyncClient, args) -> dict | None:
    """The server's GET /v1/controller, or None when it has no SLO controller (or no route)."""
    try:
        resp = await client.get("/v1/controller", headers=auth_headers(args.api_key))
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _bench(args) -> dict:
    slo = parse_goodput(args.goodput)
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    async with make_client(args) as client:
        model, max_model_len = await _discover(client, args)
        config = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "base_url": args.base_url,
                  "model": model, "workload": args.workload, "num_prompts": args.num_prompts, "seed": args.seed,
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                  "goodput": {k: v * 1000.0 for k, v in slo.items()}, "label": args.label}
        runs = []
        for rate in rates:
            reqs = build_requests(args, rate, max_model_len)
            for spec in reqs[:args.num_warmups]:
                await send_request(client, spec, model, args)
            if args.num_client_processes > 1:
                results, duration = await asyncio.to_thread(run_sharded, args, model, reqs, args.num_client_processes)
            else:
                results, duration = await run_requests(client, model, reqs, args)
            summary = summarize(results, duration, slo)
            print(format_report(summary, args.workload, rate, args.max_concurrency), flush=True)
            errors = sorted({r.error for r in results if r.error})
            if errors:
                print(f"{len(errors)} distinct errors, e.g.: {errors[0]}", file=sys.stderr)
            run_result = {**config, "request_rate": rate, **summary, "requests": per_request(results)}
            report = await _controller_report(client, args)
            if report is not None:  # where the server's SLO controller stood at the end of this rate
                run_result["controller"] = report
            runs.append(run_result)
    if not args.sweep_rates:
        return runs[0]
    rows = [{k: v for k, v in r.items() if k not in ("requests", "controller")} for r in runs]
    print(format_sweep(rows), flush=True)
    return {**config, "sweep": runs}


def _check(args) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.num_client_processes < 1:
        raise ValueError("--num-client-processes must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    if args.plot and not args.sweep_rates:
        raise ValueError("--plot draws a rate sweep; give --sweep-rates too")
    parse_goodput(args.goodput)
    if args.sweep_rates:
        try:
            rates = [float(r) for r in args.sweep_rates.split(",")]
        except ValueError:
            raise ValueError(f"--sweep-rates takes numbers separated by commas; got {args.sweep_rates!r}") from None
        if any(not r > 0 for r in rates):
            raise ValueError("--sweep-rates must be positive")


def _json_safe(obj):
    # JSON has no Infinity; an infinite rate is written as the string "inf".
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark (each rate of a sweep in turn), prints the report, writes
    --output-json and --plot, and returns what was written."""
    _check(args)
    result = asyncio.run(_bench(args))
    if args.plot:
        plot_sweep([{k: v for k, v in r.items() if k != "requests"} for r in result["sweep"]], args.plot,
                   title=f"{args.workload} - {result['model']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(_json_safe(result), f, indent=1)
        if not args.no_plots:
            _plot_beside_json(result, args)
    return result


def _plot_beside_json(result: dict, args) -> None:
    """The run's plots beside its JSON, unless --plot already names that file. A missing
    matplotlib costs the plots, never the results already written."""
    path = serve_plots.plot_path(args.output_json)
    if args.plot and os.path.abspath(args.plot) == os.path.abspath(path):
        print(f"{path} holds the --plot sweep plot; the per-run plots are not written", file=sys.stderr)
        return
    try:
        serve_plots.write_plots(result, args.output_json)
    except ValueError as e:
        print(f"no plots: {e}", file=sys.stderr)
        return
    print(f"plots: {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="deepbatch bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run(args)
    except ValueError as e:  # bad flags or an unreachable server: a message, not a traceback
        print(f"deepbatch bench serve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
