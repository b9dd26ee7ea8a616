"""How fast a server lets go of requests whose clients left: ``serve-vs-offline --disconnect R``.

Each of ``R`` rounds opens ``streams`` streamed completions that would run for a long time
(``ignore_eos``, a large ``max_tokens``), waits until every one has sent its first token (they
are all running and hold KV blocks), then closes every connection at once and polls ``/metrics``
until the engine reports nothing running or waiting. The time from the close to that report is
what a disconnect costs the server: its own detection, the abort crossing to the engine (the
engine core process, or the engine thread), the step in progress, and the report.

The report comes from the same counters an operator scrapes, so the figure includes their
delay: the engine core process sends a fresh snapshot the moment it goes idle, so that delay is
the core's step, not the 100 ms between its periodic snapshots.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]

_GAUGE = re.compile(r"^(vllm:num_requests_(?:running|waiting))\{[^}]*\} (\S+)$", re.M)
_ABORTED = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', re.M)
_POLL_S = 0.002


async def _scrape(client: httpx.AsyncClient) -> tuple[float, float]:
    """Requests running plus waiting, and requests ended by an abort so far, as ``/metrics`` says."""
    text = (await client.get("/metrics")).text
    return sum(float(v) for _, v in _GAUGE.findall(text)), sum(float(v) for v in _ABORTED.findall(text))


async def _one_round(url: str, model: str, streams: int, prompt_len: int, max_tokens: int, vocab_size: int,
                     rng: random.Random, timeout: float) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=streams + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as metrics:
        started = [asyncio.Event() for _ in range(streams)]

        async def stream(i: int) -> None:
            body = {"model": model, "prompt": [rng.randrange(vocab_size) for _ in range(prompt_len)],
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
            async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False) as client:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and '"text"' in line:
                            started[i].set()

        tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
        all_started = asyncio.create_task(asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout))
        # A stream that ends (or fails) before every stream has started spoils the round.
        await asyncio.wait([all_started, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if not all_started.done() or all_started.exception() is not None:
            ended = next((t for t in tasks if t.done()), None)
            for t in [*tasks, all_started]:
                t.cancel()
            await asyncio.gather(*tasks, all_started, return_exceptions=True)
            why = (ended.exception() or "a stream ended") if ended is not None else "timeout"
            raise RuntimeError(f"the streams did not all start: {why}")
        # The engine's counters reach /metrics a little after the fact (the engine core process
        # sends them at most every 100 ms while busy): wait until they show every stream running,
        # so that the idle reading below is about this round's disconnect, not an older snapshot.
        while True:
            busy, aborted_before = await _scrape(metrics)
            if busy >= streams:
                break
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream ended before /metrics showed every stream running")
            await asyncio.sleep(_POLL_S)
        # Cancelling a task leaves its `async with` blocks: each connection closes, as a client's would.
        start = time.perf_counter()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while True:
            busy, aborted = await _scrape(metrics)
            if not busy:
                return time.perf_counter() - start, int(aborted - aborted_before)
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"requests still held {timeout:g} s after their clients left")
            await asyncio.sleep(_POLL_S)


def probe(url: str, *, rounds: int, streams: int = 16, prompt_len: int = 32, vocab_size: int = 1000, seed: int = 0,
          timeout: float = 120.0) -> dict:
    """``rounds`` disconnects of ``streams`` running streams each; milliseconds from the close to
    an idle engine (mean, max, every round) and the aborts each round counted. Each stream asks for as many tokens as the server's
    context holds, so none ends on its own first."""
    rng = random.Random(seed)

    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False) as client:
            card = (await client.get("/v1/models")).json()["data"][0]
        max_tokens = int(card["max_model_len"]) - prompt_len
        return [await _one_round(url, card["id"], streams, prompt_len, max_tokens, vocab_size, rng, timeout)
                for _ in range(rounds)]

    results = asyncio.run(run())
    ms = [1000 * seconds for seconds, _ in results]
    # Aborts counted per round: every stream was still running when its client left.
    return {"streams": streams, "rounds": rounds, "mean_ms": statistics.fmean(ms), "max_ms": max(ms),
            "rounds_ms": ms, "aborted": [n for _, n in results]}
