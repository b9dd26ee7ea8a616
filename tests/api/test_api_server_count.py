"""``deepbatch serve --api-server-count 2``: two API processes on one port in front of one engine
core, against real processes.

- the launcher starts the core and both API processes, each under its name in ``ps``;
- connections spread over both, and ``/metrics`` from either one counts every request once;
- SIGTERM to the launcher drains both (in-flight requests finish) and leaves no process behind;
- the core is killed (SIGKILL): open streams end with an error event, everything exits non-zero;
- an API process is killed: the launcher stops the rest, and the core, within 10 s.

The core's side (each API process gets its own requests' outputs, ids unique across them):
tests/engine/test_core_process.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
from prometheus_client.multiprocess import MultiProcessCollector

from apitest_server import BackgroundStream, children, get_server, parse_metrics, wait_gone

_TINY = str(Path(__file__).resolve().parents[1] / "bench" / "tiny-qwen3.json")
_ARGS = [_TINY, "--random-weights", "--device", "cpu", "--max-model-len", "4096", "--num-gpu-blocks-override", "512",
         "--api-server-count", "2"]
SERVERS = {"two": dict(args=_ARGS), "two-core-killed": dict(args=_ARGS),
           "two-api-killed": dict(args=[*_ARGS, "--shutdown-timeout", "5"])}
TINY_MODEL = "tiny-qwen3"


def body(max_tokens: int, stream: bool) -> dict:
    return {"model": TINY_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "stream": stream,
            "ignore_eos": True}


def processes(launcher: int) -> dict[str, int]:
    """The launcher's children by title (multiprocessing's resource tracker aside)."""
    found = {}
    for pid in children(launcher):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:  # exited since the listing
            continue
        if title.startswith("deepbatch::"):
            found[title] = pid
    return found


def successes_by_process(api_pid: int) -> float:
    """Requests one API process counted as finished, from its own file in the metrics directory."""
    # The process holds its files open (prometheus_client maps them into memory).
    files = []
    for fd in Path(f"/proc/{api_pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing (a connection, a pipe)
            continue
        if target.endswith(f"/counter_{api_pid}.db"):
            files.append(target)
    assert files, f"no counter file open in API process {api_pid}"
    return sum(s.value for m in MultiProcessCollector.merge(files, accumulate=True) if m.name == "vllm:request_success"
               for s in m.samples if s.name == "vllm:request_success_total")


def test_the_launcher_runs_one_core_and_two_named_api_processes():
    server = get_server("two")
    assert Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().startswith(b"deepbatch::Launcher")
    assert set(processes(server.proc.pid)) == {"deepbatch::EngineCore", "deepbatch::APIServer_0",
                                               "deepbatch::APIServer_1"}


def test_connections_spread_over_both_and_metrics_count_each_request_once():
    server = get_server("two")
    pids = processes(server.proc.pid)
    before = server.metric("vllm:request_success_total", finished_reason="length", model_name=TINY_MODEL)
    num_requests = 32

    async def one(i: int) -> None:
        # A client of its own per request: a new connection each, for the kernel to place.
        client = server.async_client()
        try:
            out = await client.completions.create(model=TINY_MODEL, prompt=[1, 2, 3, i], max_tokens=4,
                                                  extra_body={"ignore_eos": True})
        finally:
            await client.close()
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4

    async def run():
        await asyncio.gather(*(one(i) for i in range(num_requests)))

    asyncio.run(run())
    # 2 x 2^-32 that a fair spread puts all 32 connections on one process.
    shares = [successes_by_process(pids[f"deepbatch::APIServer_{i}"]) for i in range(2)]
    assert all(share > 0 for share in shares), shares
    # Whichever process answers a scrape, the series is the sum of both, counted once.
    for _ in range(6):
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        total = parse_metrics(text)['vllm:request_success_total{finished_reason="length",model_name="tiny-qwen3"}']
        assert total == before + num_requests, (total, before, shares)
        assert text.count("# TYPE vllm:num_requests_running gauge") == 1


def test_sigterm_drains_both_api_processes_and_leaves_nothing_behind():
    server = get_server("two")
    pids = list(processes(server.proc.pid).values())

    async def run():
        clients = [server.async_http(timeout=120) for _ in range(4)]  # 4 connections: most likely both processes
        try:
            streams = [BackgroundStream(c, body(40, True)) for c in clients]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            server.terminate()
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 60)
            for s in streams:
                assert s.status == 200 and s.events[-1] == "[DONE]"
                assert s.text_and_reason()[1] == "length"
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(run())
    assert server.proc.wait(60) == 0, server.log_tail()
    for pid in pids:
        wait_gone(pid, 10)
    log = server.log_tail(500_000)
    for sign in ("ERROR", "Traceback", "terminate called", "Exception"):
        assert sign not in log, log[-4000:]


def test_a_killed_engine_core_ends_open_streams_and_every_process():
    server = get_server("two-core-killed")
    pids = processes(server.proc.pid)

    async def run():
        clients = [server.async_http(timeout=60) for _ in range(4)]
        try:
            streams = [BackgroundStream(c, body(4000, True)) for c in clients]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            os.kill(pids["deepbatch::EngineCore"], signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 10)
            for s in streams:
                assert s.events[-1] == "[DONE]" and s.events[-2]["error"]["code"] == "engine_dead", s.events[-3:]
            return killed
        finally:
            for c in clients:
                await c.aclose()

    killed = asyncio.run(run())
    code = server.proc.wait(max(0.1, 10 - (time.monotonic() - killed)))
    assert code not in (0, None), server.log_tail()
    for pid in pids.values():
        wait_gone(pid, 1)


def test_a_killed_api_process_stops_the_launcher_and_the_core():
    server = get_server("two-api-killed")
    pids = processes(server.proc.pid)
    with server.http() as client:  # the survivor serves until it is stopped
        assert client.post("/v1/completions", json=body(3, False)).status_code == 200
    os.kill(pids["deepbatch::APIServer_0"], signal.SIGKILL)
    code = server.proc.wait(10)
    assert code not in (0, None), server.log_tail()
    for pid in pids.values():
        wait_gone(pid, 1)
    assert "deepbatch::APIServer_0 exited with -9" in server.log_tail()
