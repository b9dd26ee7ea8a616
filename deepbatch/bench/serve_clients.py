"""Load from several client processes, so the load generator is never what limits a run.

One Python process parsing every SSE chunk of a thousand streams tops out below what a fast
server sends (each chunk is a JSON parse and a timestamp on one core). With
``--num-client-processes N`` the run's requests are dealt round-robin to N processes, each with
its own event loop and connection pool; all of them start at one wall-clock instant, so every
request still leaves at its scheduled offset and the Poisson arrivals stay interleaved. The
results come back in the run's order and are summarised as one run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

from deepbatch.bench.serve_metrics import RequestResult
from deepbatch.bench.serve_requests import make_client, run_requests
from deepbatch.bench.serve_workloads import RequestSpec

# Time for every process to start and open its pool before the common start instant.
START_DELAY_S = 2.0


def shard_args(args: argparse.Namespace, num_processes: int) -> argparse.Namespace:
    """One process's flags: its share of ``--max-concurrency`` (rounded up) and no progress bar."""
    shard = argparse.Namespace(**vars(args))
    shard.disable_tqdm = True
    if args.max_concurrency:
        shard.max_concurrency = math.ceil(args.max_concurrency / num_processes)
    return shard


def _shard_main(args: argparse.Namespace, model: str, reqs: list[RequestSpec],
                start_at: float) -> tuple[list[RequestResult], float]:
    async def go():
        async with make_client(args) as client:
            # Wall clock, the one clock the processes share; each then times with its own.
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await run_requests(client, model, reqs, args)

    return asyncio.run(go())


def run_sharded(args: argparse.Namespace, model: str, reqs: list[RequestSpec],
                num_processes: int) -> tuple[list[RequestResult], float]:
    """``reqs`` sent by ``num_processes`` processes; the results in ``reqs`` order and the run's
    wall time (the slowest process's, all measured from the common start)."""
    num_processes = min(num_processes, len(reqs))
    shards = [reqs[i::num_processes] for i in range(num_processes)]
    shard = shard_args(args, num_processes)
    start_at = time.time() + START_DELAY_S
    # spawn: a fork of a process with an event loop and open sockets is not safe.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_processes, mp_context=ctx) as pool:
        futures = [pool.submit(_shard_main, shard, model, part, start_at) for part in shards]
        outcomes = [f.result() for f in futures]
    results: list[RequestResult | None] = [None] * len(reqs)
    for i, (part, _) in enumerate(outcomes):
        results[i::num_processes] = part
    return results, max(duration for _, duration in outcomes)
