"""A second SIGTERM/SIGINT during the drain: every in-flight stream ends with an error event
(code "server_shutdown") and ``[DONE]``, and the process exits with EXIT_FORCED, quickly and
without a crash; a third signal stops waiting for replies and still exits with that status. On
the way, /health says what it means."""

from __future__ import annotations

import asyncio
import signal
import time

from apitest_server import BackgroundStream, MODEL, get_server
from deepbatch.api.server import EXIT_FORCED

# A long timeout: the first signal alone would let the streams run on for minutes.
_ARGS = ["--shutdown-timeout", "300", "--num-gpu-blocks-override", "256"]
SERVERS = {"forced": dict(args=_ARGS), "forced3": dict(args=_ARGS)}
# Signs of a crash at exit: a C++ abort, or a task cancelled under the app.
_CRASH_SIGNS = ("terminate called", "Traceback", "Fatal Python error")


def body(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 450, "stream": True, "ignore_eos": True}


async def start_streams(client, n: int) -> list[BackgroundStream]:
    streams = [BackgroundStream(client, body(i)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
    return streams


async def health(client) -> tuple[int, dict]:
    resp = await client.get("/health")
    return resp.status_code, resp.json()


def test_second_signal_ends_every_stream_with_an_error_and_done():
    server = get_server("forced")

    async def run():
        async with server.async_http(timeout=120) as client:
            assert await health(client) == (200, {"status": "ok"})
            streams = await start_streams(client, 3)
            server.terminate()
            deadline = time.monotonic() + 10
            while (await health(client)) != (503, {"status": "draining"}):
                assert time.monotonic() < deadline, await health(client)
                await asyncio.sleep(0.05)
            assert not any(s.task.done() for s in streams), "the drain lets the streams run"
            forced_at = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 15)
            return streams, forced_at

    streams, forced_at = asyncio.run(run())
    for s in streams:
        assert s.status == 200
        *tokens, error, done = s.events
        assert done == "[DONE]", s.events[-3:]
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
        assert error["error"]["code"] == "server_shutdown", error
        assert tokens and all(e.get("choices") for e in tokens)
        assert all(e["choices"][0].get("finish_reason") is None for e in tokens), "cut, not finished"
    assert server.proc.wait(15) == EXIT_FORCED, server.log_tail()
    assert time.monotonic() - forced_at < 15
    log = server.log_tail(500_000)
    assert not any(sign in log for sign in _CRASH_SIGNS), log[-4000:]


def test_third_signal_exits_at_once_without_a_crash():
    server = get_server("forced3")

    async def run():
        async with server.async_http(timeout=120) as client:
            streams = await start_streams(client, 2)
            # Alternating signals: two pending signals of one kind would merge into one.
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                server.proc.send_signal(sig)
                await asyncio.sleep(0.2)
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams), return_exceptions=True), 15)

    started = time.monotonic()
    asyncio.run(run())
    assert server.proc.wait(15) == EXIT_FORCED, server.log_tail()  # never -6 (SIGABRT)
    assert time.monotonic() - started < 30
    assert "terminate called" not in server.log_tail(500_000)
