"""The sending half of ``deepbatch bench serve``: one streamed completion timed chunk by chunk
(``send_request``), a list of them sent at their arrival offsets (``run_requests``), and the
HTTP client they share. Used by the load generator in one process and by each of its client
processes (``serve_clients.py``)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]

from deepbatch.bench.serve_metrics import RequestResult
from deepbatch.bench.serve_workloads import RequestSpec


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}



async def send_request(client: httpx.AsyncClient, spec: RequestSpec, model: str, args) -> RequestResult:
    """One streaming completion, timed. Never raises for the server's or the network's faults:
    they come back as ``success=False`` with ``error`` set, so one bad request cannot end a run."""
    res = RequestResult(spec.group, spec.prompt_len, spec.output_len)
    payload = {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = auth_headers(args.api_key)
    if spec.user is not None:
        payload["user"] = spec.user
        headers["X-Tenant-Id"] = spec.user
    start = last = time.perf_counter()
    first: float | None = None
    chunks, usage_tokens, done = 0, None, False
    try:
        async with asyncio.timeout(args.timeout):
            async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {body[:200]}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments and keep-alives
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"not an object: {data[:100]}")
                    if "error" in chunk:  # errors after the 200 arrive inside the stream
                        res.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                        return res
                    if chunk.get("choices"):
                        if first is None:
                            first = now
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                    usage = chunk.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens")
                        if usage.get("prompt_tokens"):
                            res.prompt_len = int(usage["prompt_tokens"])
    except TimeoutError:
        res.error = f"timeout after {args.timeout:g} s"
        return res
    except httpx.HTTPError as e:  # connection refused or reset, a stream cut mid-body
        res.error = f"{type(e).__name__}: {e}"
        return res
    except ValueError as e:  # a chunk that is not JSON
        res.error = f"bad chunk: {e}"
        return res
    end = time.perf_counter()
    if not done:
        res.error = "stream ended before [DONE]"
    elif first is None:
        res.error = "no output chunk"
    else:
        res.success = True
        res.ttft = first - start
        res.e2el = end - start
        res.output_tokens = int(usage_tokens) if usage_tokens is not None else chunks
    return res


async def run_requests(client: httpx.AsyncClient, model: str, reqs: list[RequestSpec], args) -> tuple[list[RequestResult], float]:
    """Sends ``reqs`` at their offsets (one task each, so a slow request never delays the next
    send) and waits for all of them; returns the results in ``reqs`` order and the wall time."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), file=sys.stderr, leave=False)

    async def one(spec: RequestSpec) -> RequestResult:
        async def go() -> RequestResult:
            sent = time.perf_counter() - t0
            res = await send_request(client, spec, model, args)
            res.send_s = sent
            if bar is not None:
                bar.update(1)
            return res

        if sem is None:
            return await go()
        async with sem:
            return await go()

    tasks = []
    t0 = time.perf_counter()
    for spec in reqs:
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


def make_client(args) -> httpx.AsyncClient:
    # No pool limit beyond the run's own: a pool queue would add its wait to every TTFT. Proxies
    # from the environment are ignored; the target is the server named, nothing in between.
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    return httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(args.timeout), limits=limits,
                             trust_env=False)
