"""The soak's phases and what is sampled during them, across ``--num-clients`` load processes.

- saturation: closed-loop clients keep requests in flight; ``find_saturation`` turns their
  completions into a rate;
- soak: Poisson arrivals at a rate, while the server's /stats gauges, /metrics and host RSS are
  sampled every ``--sample-interval-s``;
- end: wait for the server to go idle and read its last /stats.

Each process runs its share of the phase; the counts of every outcome (and of requests sent) are
kept in a shared array, so the sampler in the first process sees the whole load's progress.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue as queue_module
import sys
import time
from collections import Counter

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]

from deepbatch.bench.soak_client import OUTCOMES, Jobs, make_client, send

_SENT = len(OUTCOMES)  # index of the "sent" counter in the shared progress array


def _count(counters, outcome: str) -> None:
    if counters is not None:
        with counters.get_lock():
            counters[OUTCOMES.index(outcome)] += 1


async def _open_loop(args, model, max_model_len, rate, seed, share, t0, counters) -> list[dict]:
    results: list[dict] = []
    tasks: set = set()

    def done(task) -> None:
        tasks.discard(task)
        if task.exception() is not None:  # a fault of this tool: the request goes unrecorded, and
            print(f"soak: client error: {task.exception()!r}", file=sys.stderr)  # the verdict says so
            return
        rec = task.result()
        results.append(rec)
        _count(counters, rec["outcome"])

    async with make_client(args) as client:
        for job in Jobs(args, model, max_model_len, rate, seed, mixed=True, share=share):
            if job.at >= args.duration_s:
                break
            delay = t0 + job.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(client, job, t0, args.timeout))
            tasks.add(task)
            task.add_done_callback(done)
            if counters is not None:
                with counters.get_lock():
                    counters[_SENT] += 1
        while tasks:
            await asyncio.wait(set(tasks))
    return results


async def _closed_loop(args, model, max_model_len, concurrency, seed, t0, counters) -> dict:
    """``concurrency`` clients, each sending its next request when the last one ends, until the
    phase ends; the requests still running then are cancelled (the server sees disconnects)."""
    ends: list[float] = []
    outcomes: Counter = Counter()
    jobs = iter(Jobs(args, model, max_model_len, math.inf, seed, mixed=False))

    async def client_loop(client) -> None:
        while time.monotonic() - t0 < args.saturation_s:
            rec = await send(client, next(jobs), t0, args.timeout)
            outcomes[rec["outcome"]] += 1
            _count(counters, rec["outcome"])
            if rec["outcome"] == "completed":
                ends.append(rec["end"])
            else:
                await asyncio.sleep(0.1)  # a rejection returns at once; do not spin on it

    async with make_client(args) as client:
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        loops = [asyncio.create_task(client_loop(client)) for _ in range(concurrency)]
        await asyncio.sleep(max(0.0, t0 + args.saturation_s - time.monotonic()))
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    return {"ends": ends, "outcomes": dict(outcomes)}


def _run_async(coro):
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _phase(phase: str, args, model, max_model_len, rate, index: int, t0: float, counters):
    seed, n = args.seed + 7919 * index, args.num_clients
    if phase == "saturation":
        conc = args.saturation_concurrency // n + (index < args.saturation_concurrency % n)
        return _closed_loop(args, model, max_model_len, conc, seed, t0, counters)
    return _open_loop(args, model, max_model_len, rate / n, seed, (index, n), t0, counters)


def _child(phase, args, model, max_model_len, rate, index, t0, counters, queue) -> None:
    raise_fd_limit()
    queue.put((index, _run_async(_phase(phase, args, model, max_model_len, rate, index, t0, counters))))


def raise_fd_limit() -> None:
    try:  # every request in flight holds a socket
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


# -- the server side: gauges, memory, idleness ------------------------------------------------------


def host_rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


async def sample_server(client, args, t0: float, counters, scrapes: Counter) -> dict:
    """One sample: /stats gauges, the /metrics status, the server's host RSS, client-side counts."""
    s = {"t": round(time.monotonic() - t0, 3), "host_rss_bytes": host_rss_bytes(args.server_pid)}
    for path in ("/stats", "/metrics"):
        began = time.monotonic()
        try:
            resp = await client.get(path, timeout=30)
            ok = resp.status_code == 200
            if ok and path == "/stats":
                stats = resp.json()
                alloc = stats.get("gpu_allocator") or {}
                s.update(num_requests_running=stats["num_requests_running"],
                         num_requests_waiting=stats["num_requests_waiting"], kv_cache_usage=stats["kv_cache_usage"],
                         gpu_allocated_bytes=alloc.get("allocated_bytes"),
                         gpu_reserved_bytes=alloc.get("reserved_bytes"),
                         num_preemptions=(stats.get("num_preemptions") or {}).get("total"))
            elif not ok:
                scrapes[f"{path} HTTP {resp.status_code}: {resp.text[:120]}"] += 1
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ok = False
            scrapes[f"{path} {type(e).__name__}: {e}"[:160]] += 1
        s[f"{path[1:]}_ms"] = round((time.monotonic() - began) * 1000.0, 1)
        s[f"{path[1:]}_ok"] = ok
    if counters is not None:
        with counters.get_lock():
            s["sent"] = counters[_SENT]
            s.update({o: counters[i] for i, o in enumerate(OUTCOMES)})
    return s


async def wait_idle(client, timeout: float) -> tuple[float | None, dict | None]:
    """Seconds until /stats shows nothing running or waiting (None if it never did), and the
    /stats read a moment after that (the engine publishes its last snapshot as it goes idle)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        try:
            stats = (await client.get("/stats", timeout=10)).json()
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
                idle_after = time.monotonic() - began
                await asyncio.sleep(1.0)
                return idle_after, (await client.get("/stats", timeout=10)).json()
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.5)
    return None, None


# -- phases across processes ------------------------------------------------------------------------


async def _sampler(control, args, t0: float, counters, samples: list, scrapes: Counter, stop: asyncio.Event) -> None:
    next_print = 0.0
    while not stop.is_set():
        s = await sample_server(control, args, t0, counters, scrapes)
        samples.append(s)
        if s["t"] >= next_print:
            next_print = s["t"] + args.progress_interval_s
            print(_progress_line(s), flush=True)
        try:
            await asyncio.wait_for(stop.wait(), args.sample_interval_s)
        except TimeoutError:
            pass


def _progress_line(s: dict) -> str:
    mib = lambda v: f"{v / 2 ** 20:.0f}" if v is not None else "-"  # noqa: E731
    return (f"[{s['t']:7.1f} s] sent {s.get('sent', 0)} completed {s.get('completed', 0)} "
            f"429 {s.get('rejected_429', 0)} 4xx {s.get('rejected_400', 0) + s.get('rejected_4xx', 0)} "
            f"5xx {s.get('http_5xx', 0) + s.get('error_event_5xx', 0)} lost {s.get('lost', 0)} "
            f"disc {s.get('disconnected', 0)} | running {s.get('num_requests_running', '-')} "
            f"waiting {s.get('num_requests_waiting', '-')} kv {s.get('kv_cache_usage', float('nan')):.2f} "
            f"rss {mib(s['host_rss_bytes'])} MiB gpu {mib(s.get('gpu_allocated_bytes'))} MiB")


async def _drive(phase: str, args, model, max_model_len, rate, t0, counters, queue, procs) -> dict:
    """Runs this process's share of the phase; for the soak, samples the server throughout and
    after the load, until it is idle. Returns every process's result and the samples."""
    samples: list[dict] = []
    scrapes: Counter = Counter()
    stop = asyncio.Event()
    async with make_client(args, limit=4) as control:
        sampler = asyncio.create_task(_sampler(control, args, t0, counters, samples, scrapes, stop)) \
            if phase == "soak" else None
        results = {0: await _phase(phase, args, model, max_model_len, rate, 0, t0, counters)}
        while len(results) < len(procs) + 1:  # read the queue before joining: a full pipe blocks exit
            try:
                index, res = queue.get_nowait()
                results[index] = res
            except queue_module.Empty:
                dead = [p for i, p in enumerate(procs, 1) if i not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a load process exited with {dead[0].exitcode}") from None
                await asyncio.sleep(0.2)
        load_end = time.monotonic() - t0
        idle_after, end_stats = await wait_idle(control, args.idle_timeout_s)
        health = None
        try:
            health = (await control.get("/health", timeout=10)).status_code
        except httpx.HTTPError:
            pass
        if sampler is not None:
            samples.append(await sample_server(control, args, t0, counters, scrapes))
            stop.set()
            await sampler
    return {"results": [results[i] for i in sorted(results)], "samples": samples, "scrapes": scrapes,
            "load_end_s": load_end, "idle_after_s": idle_after, "end_stats": end_stats, "health": health}


def run_phase(phase: str, args, model: str, max_model_len: int | None, rate: float = math.inf) -> dict:
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", len(OUTCOMES) + 1)
    queue = ctx.Queue()
    # Children start together with this process at t0, after their imports.
    t0 = time.monotonic() + (2.0 if args.num_clients > 1 else 0.2)
    procs = [ctx.Process(target=_child, args=(phase, args, model, max_model_len, rate, i, t0, counters, queue),
                         daemon=True) for i in range(1, args.num_clients)]
    for p in procs:
        p.start()
    try:
        out = _run_async(_drive(phase, args, model, max_model_len, rate, t0, counters, queue, procs))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    out["sent"] = counters[_SENT]
    return out


def warm_up(args, model, max_model_len) -> dict:
    """One plain request to its end, alone, before saturation is measured: a cold server's first
    steps (allocations, first calls into its kernels) would otherwise fall in the measured window,
    and on a slow host could fill it. Its prompt is drawn apart from the phases' (no prefix hits)."""
    async def one() -> dict:
        async with make_client(args) as client:
            job = next(iter(Jobs(args, model, max_model_len, math.inf, args.seed + 7919 * args.num_clients,
                                 mixed=False)))
            return await send(client, job, time.monotonic(), args.timeout)

    return _run_async(one())


def find_saturation(args, model, max_model_len) -> dict:
    first = warm_up(args, model, max_model_len)
    if first["outcome"] != "completed":
        print(f"warm-up request: {first['outcome']} {first['error']}".rstrip(), flush=True)
    out = run_phase("saturation", args, model, max_model_len)
    warm = args.saturation_s / 4.0
    ends = [t for r in out["results"] for t in r["ends"] if warm <= t <= args.saturation_s]
    outcomes = sum((Counter(r["outcomes"]) for r in out["results"]), Counter())
    rate = len(ends) / (args.saturation_s - warm)
    print(f"saturation: {rate:.2f} req/s completed at {args.saturation_concurrency} in flight "
          f"({dict(outcomes)}), the server idle again: {out['idle_after_s'] is not None}", flush=True)
    return {"rate": rate, "concurrency": args.saturation_concurrency, "duration_s": args.saturation_s,
            "window_s": args.saturation_s - warm, "completed_in_window": len(ends), "outcomes": dict(outcomes),
            "idle_after_s": out["idle_after_s"]}
