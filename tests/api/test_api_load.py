"""Under load: abandoned requests free their seats and KV blocks at once, and a burst of 200
requests at concurrency 32 all succeed with the metrics counting exactly what clients saw."""

from __future__ import annotations

import asyncio
import time

import pytest

from apitest_server import MAIN_SERVER, MODEL, get_server, metric_key

SERVERS = {"main": MAIN_SERVER}


@pytest.fixture(scope="module")
def server():
    return get_server("main")


def wait_idle(server, idle_kv: float, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        running = server.metric("vllm:num_requests_running")
        waiting = server.metric("vllm:num_requests_waiting")
        kv = server.metric("vllm:kv_cache_usage_perc")
        if (running, waiting, kv) == (0, 0, idle_kv) or time.monotonic() > deadline:
            return {"running": running, "waiting": waiting, "kv": kv}
        time.sleep(0.2)


def test_abandoned_streams_are_aborted(server):
    idle_kv = wait_idle(server, 0.0)["kv"]
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    started = []

    async def abandon(client, i):
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            started.append(i)
            async for _ in resp.aiter_lines():
                pass
        raise AssertionError("a 400-token stream should not finish within the client timeout")

    async def run():
        async with server.async_http(timeout=30) as client:
            # The client gives up after 0.5 s; leaving the `async with` closes each connection.
            results = await asyncio.gather(
                *(asyncio.wait_for(abandon(client, i), timeout=0.5) for i in range(64)), return_exceptions=True)
        assert all(isinstance(r, asyncio.TimeoutError) for r in results), [r for r in results][:3]

    asyncio.run(run())

    # Served while the aborts free the engine: left running, the 64 streams would hold 25,600 decode
    # tokens ahead of it (400 steps of 64 sequences, minutes on two cores). The bound leaves room
    # for a loaded machine, where the steps under way when the aborts arrive take seconds.
    t0 = time.monotonic()
    with server.http(timeout=20) as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 8})
    assert resp.status_code == 200 and time.monotonic() - t0 < 20.0
    state = wait_idle(server, idle_kv)
    assert state == {"running": 0, "waiting": 0, "kv": idle_kv}
    # Every stream the client saw start ended as an abort; a request cancelled while still being
    # tokenized never reached the engine, one cancelled just before its headers arrived did.
    aborted = server.metric("vllm:request_success_total", finished_reason="abort") - aborted_before
    assert len(started) <= aborted <= 64


def test_load_200_requests_concurrency_32(server):
    before = server.metrics()
    sem = asyncio.Semaphore(32)
    seen = {"prompt": 0, "completion": 0, "ok": 0, "failed": []}

    async def one(client, i):
        async with sem:
            try:
                if i % 2:
                    out = await client.completions.create(model=MODEL, prompt=f"Request {i}: the answer is",
                                                          max_tokens=2 + i % 3, temperature=0.7, seed=i)
                    usage = out.usage
                elif i % 4 == 0:
                    usage = None
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=3, stream=True,
                        stream_options={"include_usage": True})
                    async for chunk in stream:
                        usage = chunk.usage or usage
                else:
                    out = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=3)
                    usage = out.usage
                seen["prompt"] += usage.prompt_tokens
                seen["completion"] += usage.completion_tokens
                seen["ok"] += 1
            except Exception as e:  # counted, so the assertion shows every failure at once
                seen["failed"].append(repr(e))

    async def run():
        client = server.async_client(timeout=300)
        await asyncio.gather(*(one(client, i) for i in range(200)))
        await client.close()

    asyncio.run(run())
    assert seen["failed"] == [] and seen["ok"] == 200
    after = server.metrics()

    def delta(name, **labels):
        key = metric_key(name, {"model_name": MODEL, **labels})
        return after.get(key, 0.0) - before.get(key, 0.0)

    finished = sum(delta("vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 200
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    assert delta("vllm:prompt_tokens_total") == seen["prompt"]
    assert delta("vllm:generation_tokens_total") == seen["completion"]
    assert delta("vllm:e2e_request_latency_seconds_count") == 200
    assert delta("vllm:time_to_first_token_seconds_count") == 200
    assert delta("vllm:request_queue_time_seconds_count") == 200
    assert delta("vllm:inter_token_latency_seconds_count") == seen["completion"] - 200
    assert delta("vllm:prefix_cache_queries_total") > 0
