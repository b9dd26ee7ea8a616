"""The engine core in its own process, against real processes: it carries its name, dies cleanly
with its server in either order, and a client that goes away frees its KV blocks in the core.

- the core is killed (SIGKILL): every open stream ends with an error event and [DONE], a request
  in flight gets a 500 with the OpenAI error body, /health answers 503 "dead", and the server
  exits non-zero within 10 s;
- the server is killed (SIGKILL): the core exits on its own within 10 s, and with tensor
  parallelism its worker processes with it.

SIGTERM drains across both processes and leaves neither behind: test_api_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from apitest_server import BackgroundStream, assert_error, children, engine_core_pid, get_server, wait_gone

# A tiny random model (token ids in and out): these tests are about processes, not text, and the
# servers then cost little memory beside the others the API tests run.
_TINY = str(Path(__file__).resolve().parents[1] / "bench" / "tiny-qwen3.json")
_ARGS = [_TINY, "--random-weights", "--device", "cpu", "--max-model-len", "4096", "--num-gpu-blocks-override", "512"]
# Two ranks on the CPU (gloo): the core is rank 0, the worker its child.
_TP2 = [*_ARGS, "--tensor-parallel-size", "2"]
SERVERS = {"core-killed": dict(args=_ARGS), "server-killed": dict(args=_ARGS), "tp2-killed": dict(args=_TP2)}
TINY_MODEL = "tiny-qwen3"


def body(max_tokens: int, stream: bool) -> dict:
    return {"model": TINY_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True}


def test_a_killed_engine_core_fails_open_requests_and_the_server_exits_nonzero():
    server = get_server("core-killed")
    core = engine_core_pid(server.proc.pid)

    async def run():
        async with server.async_http(timeout=60) as client:
            # Long enough to be running when the core dies (a few ms a token).
            streams = [BackgroundStream(client, body(4000, True)) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            plain = asyncio.ensure_future(client.post("/v1/completions", json=body(4000, False)))
            await asyncio.sleep(0.3)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            assert_error(await asyncio.wait_for(plain, 10), 500, None, "engine_dead")
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 10)
            for s in streams:
                assert s.events[-1] == "[DONE]" and s.events[-2]["error"]["code"] == "engine_dead", s.events[-3:]
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead", health.text
            return killed

    killed = asyncio.run(run())
    code = server.proc.wait(max(0.1, 10 - (time.monotonic() - killed)))
    assert code not in (0, None), server.log_tail()


def test_a_killed_server_takes_its_engine_core_with_it():
    server = get_server("server-killed")
    assert Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().startswith(b"deepbatch::APIServer")
    core = engine_core_pid(server.proc.pid)
    server.proc.kill()
    server.proc.wait(10)
    wait_gone(core, 10)


def test_a_tensor_parallel_core_serves_and_its_workers_go_with_a_killed_server():
    server = get_server("tp2-killed")
    core = engine_core_pid(server.proc.pid)
    workers = children(core)
    assert workers, "rank 1 runs in a child process of the engine core"
    with server.http() as client:
        resp = client.post("/v1/completions", json=body(5, False))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 5
    server.proc.kill()
    server.proc.wait(10)
    for pid in [core, *workers]:
        wait_gone(pid, 10)
