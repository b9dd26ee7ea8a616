"""Process lifecycle: a full waiting queue answers 429, SIGTERM drains (in-flight requests finish,
or end with finish_reason "abort" at the shutdown timeout) and the process exits 0 with nothing
in its log that reads as a failure, and a fault in a model step fails in-flight requests cleanly,
turns /health to 503 ("dead", with the error) and exits non-zero."""

from __future__ import annotations

import asyncio
import time

from apitest_server import BackgroundStream, MODEL, assert_error, engine_core_pid, get_server, wait_gone

SERVERS = {
    # Two seats and a two-deep waiting queue, so the queue fills with four requests.
    "drain30": dict(args=["--shutdown-timeout", "30", "--max-num-seqs", "2", "--max-queued-requests", "2",
                          "--num-gpu-blocks-override", "256"]),
    "drain0": dict(args=["--shutdown-timeout", "0", "--num-gpu-blocks-override", "256"]),
    "fault": dict(args=["--num-gpu-blocks-override", "256"], env={"DEEPBATCH_FAULT_INJECT_STEP": "12"}),
}


def body(max_tokens: int, stream: bool, prompt: str = "Once upon a time") -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


async def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_queue_full_is_429():
    server = get_server("drain30")

    async def run():
        async with server.async_http(timeout=120) as client:
            running = [BackgroundStream(client, body(300, True)) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in running)), 60)
            waiting = [BackgroundStream(client, body(8, True)) for _ in range(2)]
            await wait_for(lambda: all(s.status == 200 for s in waiting), 30)
            resp = await client.post("/v1/completions", json=body(4, False))
            assert_error(resp, 429, None, "queue_full")
            assert resp.headers["retry-after"]
            for s in running + waiting:
                s.task.cancel()
            await asyncio.gather(*(s.task for s in running + waiting), return_exceptions=True)

    asyncio.run(run())
    deadline = time.monotonic() + 20
    while server.metric("vllm:num_requests_running") or server.metric("vllm:num_requests_waiting"):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_sigterm_lets_in_flight_requests_finish():
    server = get_server("drain30")
    core = engine_core_pid(server.proc.pid)

    async def run():
        async with server.async_http(timeout=120) as client:
            streams = [BackgroundStream(client, body(24, True, f"Story {i}:")) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            server.terminate()
            deadline = time.monotonic() + 10
            while (health := await client.get("/health")).status_code != 503:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert health.json() == {"status": "draining"}
            assert not all(s.task.done() for s in streams), "the requests should still be running"
            assert_error(await client.post("/v1/completions", json=body(4, False)), 503, None, "server_draining")
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 60)
            for s in streams:
                assert s.status == 200 and s.events[-1] == "[DONE]"
                text, reason = s.text_and_reason()
                assert reason == "length" and text

    asyncio.run(run())
    assert server.proc.wait(60) == 0, server.log_tail()
    wait_gone(core, 10)  # the engine core process went with it
    log = server.log_tail(500_000)
    for sign in ("ERROR", "Traceback", "terminate called", "Exception"):
        assert sign not in log, log[-4000:]


def test_sigterm_with_zero_timeout_aborts_in_flight_requests():
    server = get_server("drain0")

    async def run():
        async with server.async_http(timeout=120) as client:
            streams = [BackgroundStream(client, body(400, True, f"Story {i}:")) for i in range(2)]
            plain = asyncio.ensure_future(client.post("/v1/completions", json=body(400, False)))
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            await asyncio.sleep(0.3)  # the non-streaming request is in the engine too by now
            server.terminate()
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 30)
            for s in streams:
                assert s.events[-1] == "[DONE]"
                assert s.text_and_reason()[1] == "abort"
            resp = await asyncio.wait_for(plain, 30)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["finish_reason"] == "abort" and resp.json()["usage"]["completion_tokens"] < 400

    asyncio.run(run())
    assert server.proc.wait(60) == 0, server.log_tail()


def test_engine_fault_fails_requests_and_exits_nonzero():
    server = get_server("fault")

    async def run():
        async with server.async_http(timeout=60) as client:
            stream = BackgroundStream(client, body(200, True))
            plain = await client.post("/v1/completions", json=body(200, False, "Another story"))
            err = assert_error(plain, 500, None, "engine_dead")
            assert "injected fault" in err["message"]
            await asyncio.wait_for(stream.task, 30)
            assert stream.status == 200 and stream.events[-1] == "[DONE]"
            assert "error" in stream.events[-2] and stream.events[-2]["error"]["code"] == "engine_dead"
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
            assert "injected fault" in health.json()["error"]
            assert_error(await client.post("/v1/completions", json=body(4, False)), 503, None, "engine_dead")

    asyncio.run(run())
    code = server.proc.wait(60)
    assert code not in (0, None), server.log_tail()
    assert "injected fault" in server.log_tail(200_000)
