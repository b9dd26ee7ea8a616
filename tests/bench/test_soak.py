"""The soak tool: how one request's end is classified (against canned answers in the server's own
wire format), how memory flatness is judged (on series with known answers), and a short soak
against a real CPU server on the embedded model, whose end state is read back from the server."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from deepbatch.api.errors import APIError, error_body
from deepbatch.api.protocol import CompletionChoice, CompletionChunk, UsageInfo
from deepbatch.bench import soak

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-soak-test"

# -- one request's outcome --------------------------------------------------------------------------


def _chunk(text: str | None = "x", finish: str | None = None, usage: bool = False) -> bytes:
    choices = [] if text is None else [CompletionChoice(index=0, text=text, finish_reason=finish)]
    c = CompletionChunk(id="cmpl-1", created=0, model="m", choices=choices,
                        usage=UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7) if usage else None)
    return f"data: {c.model_dump_json(exclude_none=True)}\n\n".encode()


def _error(status: int, code: str) -> bytes:
    return f"data: {json.dumps(error_body(APIError(status, 'boom', code=code)))}\n\n".encode()


DONE = b"data: [DONE]\n\n"
FULL = [_chunk(), _chunk(), _chunk(), _chunk(finish="length"), _chunk(None, usage=True), DONE]


def _sse(*events: bytes, fail: Exception | None = None, pieces: int = 7):
    """A streamed body cut into pieces that straddle event boundaries; raises ``fail`` at the end."""
    async def body():
        data = b"".join(events)
        for i in range(0, len(data), pieces):
            yield data[i:i + pieces]
        if fail is not None:
            raise fail
    return body


def _classify(respond, kind="stream", disconnect_after=None, timeout=5.0) -> dict:
    async def handler(request: httpx.Request) -> httpx.Response:
        return await respond(request) if asyncio.iscoroutinefunction(respond) else respond(request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://soak") as client:
            job = soak.Job(kind, "/v1/completions", b"{}", 0.0, disconnect_after=disconnect_after)
            return await soak.send(client, job, time.monotonic(), timeout)

    return asyncio.run(go())


def _stream(*events, fail=None):
    return lambda req: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                      content=_sse(*events, fail=fail)())


def test_a_finished_stream_is_completed_with_its_ttft_and_chunks():
    rec = _classify(_stream(*FULL))
    assert rec["outcome"] == "completed" and rec["status"] == 200
    assert rec["chunks"] == 4 and rec["ttft"] is not None and rec["ttft"] <= rec["end"] - rec["send"]


@pytest.mark.parametrize("events, fail, why", [
    (FULL[:3], None, "ends after 3 chunks, no finish_reason, no [DONE]"),
    (FULL[:3] + [DONE], None, "[DONE] without a finish_reason"),
    (FULL[:2], httpx.ReadError("connection reset"), "the connection breaks mid-stream"),
    ([_chunk(), b"data: {not json\n\n"], None, "an event that is not JSON"),
])
def test_a_stream_the_server_never_ended_is_lost(events, fail, why):
    rec = _classify(_stream(*events, fail=fail))
    assert rec["outcome"] == "lost", why
    assert rec["error"]


@pytest.mark.parametrize("status, code, outcome", [
    (500, "request_failed", "error_event_5xx"), (503, "engine_dead", "error_event_5xx"),
    (400, "invalid_value", "error_event"),
])
def test_an_error_event_is_a_clean_end_split_by_its_type(status, code, outcome):
    rec = _classify(_stream(_chunk(), _error(status, code), DONE))
    assert rec["outcome"] == outcome and "boom" in rec["error"]


def test_a_client_that_closes_the_stream_is_counted_as_disconnected_not_lost():
    sent = []

    def respond(request):
        async def body():
            for e in FULL[:-3] + [_chunk()] * 50 + FULL[-3:]:
                sent.append(e)
                yield e
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    rec = _classify(respond, kind="disconnect", disconnect_after=2)
    assert rec["outcome"] == "disconnected" and rec["chunks"] == 2
    assert len(sent) < 10  # it stopped reading; the rest was never pulled
    assert _classify(_stream(*FULL), kind="disconnect", disconnect_after=0)["outcome"] == "disconnected"
    # A stream that finishes before the client meant to leave has simply completed.
    assert _classify(_stream(*FULL), kind="disconnect", disconnect_after=40)["outcome"] == "completed"


@pytest.mark.parametrize("status, outcome", [(429, "rejected_429"), (400, "rejected_400"), (413, "rejected_4xx"),
                                             (404, "rejected_4xx"), (500, "http_5xx"), (503, "http_5xx")])
def test_http_statuses(status, outcome):
    body = error_body(APIError(status, "no", code="x"))
    rec = _classify(lambda req: httpx.Response(status, json=body))
    assert (rec["outcome"], rec["status"]) == (outcome, status)


@pytest.mark.parametrize("answer, outcome", [
    ({"choices": [{"index": 0, "text": "ab", "finish_reason": "length"}]}, "completed"),
    ({"choices": [{"index": 0, "text": "ab"}]}, "lost"),
    ({"choices": []}, "lost"),
    ({"error": {"message": "boom", "type": "internal_server_error", "code": "x"}}, "error_event_5xx"),
])
def test_non_streaming_answers(answer, outcome):
    assert _classify(lambda req: httpx.Response(200, json=answer), kind="non_stream")["outcome"] == outcome


def test_no_connection_is_a_connect_error_and_no_answer_in_time_is_lost():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    assert _classify(refuse)["outcome"] == "connect_error"

    async def hang(request):
        await asyncio.sleep(5)

    rec = _classify(hang, timeout=0.2)
    assert rec["outcome"] == "lost" and "0.2 s" in rec["error"]


# -- memory flatness --------------------------------------------------------------------------------


def _series(values) -> list[dict]:
    return [{"t": float(t), "m": v} for t, v in enumerate(values)]


def test_a_step_up_after_warm_up_is_not_flat():
    # warm-up 0..9 at 500 (ignored), 100 until t=50, then 110: first window [10, 30] vs last [80, 100].
    s = _series([500.0] * 10 + [100.0] * 40 + [110.0] * 51)
    f = soak.flatness(s, "m", warmup_s=10, end_s=100, window_s=20, tolerance=0.05)
    assert f["first_window_mean"] == 100.0 and f["last_window_mean"] == 110.0
    assert f["relative_change"] == pytest.approx(0.10) and f["flat"] is False
    assert soak.flatness(s, "m", warmup_s=10, end_s=100, window_s=20, tolerance=0.15)["flat"] is True
    # The same step judged against an absolute bound too: 10 units is past 8, within 12.
    for bound, flat in ((8, False), (12, True)):
        assert soak.flatness(s, "m", 10, 100, 20, tolerance=0.15, tolerance_bytes=bound)["flat"] is flat


def test_steady_growth_within_the_tolerance_is_still_not_flat():
    s = _series([1000.0 + 0.2 * t for t in range(101)])  # +2% over the run: a leak, however slow
    f = soak.flatness(s, "m", warmup_s=10, end_s=100, window_s=20, tolerance=0.05)
    assert abs(f["relative_change"]) < 0.05 and f["monotonic_growth"] is True and f["flat"] is False
    assert f["slope_per_min"] == pytest.approx(0.2 * 60)
    # Growth below the noise floor given is not called growth: the segment means rise by ~15 units.
    assert soak.flatness(s, "m", warmup_s=10, end_s=100, window_s=20, tolerance=0.05, min_rise=20)["flat"] is True


def test_noise_around_a_level_is_flat_and_too_few_samples_is_no_answer():
    noise = [1000.0 + (7 * t % 11 - 5) for t in range(101)]
    f = soak.flatness(_series(noise), "m", warmup_s=10, end_s=100, window_s=20, tolerance=0.05)
    assert f["flat"] is True and f["monotonic_growth"] is False
    assert soak.flatness(_series([1.0, 2.0, 3.0]), "m", warmup_s=0, end_s=2, window_s=1, tolerance=0.05) is None
    assert soak.flatness(_series([None] * 50), "m", warmup_s=0, end_s=49, window_s=10, tolerance=0.05) is None


# -- a short soak against the real server -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """The embedded model with two sequences per step and a waiting queue of two, so a few
    requests per second already overload it and draw 429s."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepbatch.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "512", "--num-gpu-blocks-override", "512", "--max-num-seqs", "2",
         "--max-queued-requests", "2", "--api-key", API_KEY],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DEEPBATCH_LOG_STATS_INTERVAL": "0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, Path(log.name).read_text()[-4000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, Path(log.name).read_text()[-4000:]
        time.sleep(0.5)
    yield url, proc
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    os.unlink(log.name)


def test_soak_against_the_cpu_server(server, tmp_path, capsys):
    url, proc = server
    p = argparse.ArgumentParser()
    soak.add_arguments(p)
    args = p.parse_args([
        "--url", url, "--api-key", API_KEY, "--server-pid", str(proc.pid), "--find-saturation",
        "--saturation-s", "4", "--saturation-concurrency", "3", "--duration-s", "10", "--rate", "8",
        "--num-clients", "2", "--workload", "random", "--random-input-len", "16", "--random-output-len", "6",
        "--vocab-size", "49152", "--hostile-fraction", "0.5", "--disconnect-fraction", "0.25",
        "--non-stream-fraction", "0.1", "--sample-interval-s", "1", "--warmup-s", "2", "--window-s", "4",
        "--idle-timeout-s", "60", "--timeout", "60", "--out", str(tmp_path / "r.json"),
        "--requests-out", str(tmp_path / "req.jsonl.gz")])
    r = soak.run(args)
    assert json.loads((tmp_path / "r.json").read_text())["outcomes"] == r["outcomes"]

    # Every request sent ended in exactly one outcome, and every breakdown adds up to the same.
    n = r["sent"]
    assert n == r["recorded"] == sum(r["outcomes"].values()) > 30
    assert sum(sum(k.values()) for k in r["by_kind"].values()) == n
    assert sum(sum(h["outcomes"].values()) for h in r["hostile"].values()) == sum(r["by_kind"]["hostile"].values())
    lines = [json.loads(x) for x in gzip.open(tmp_path / "req.jsonl.gz", "rt")]
    assert len(lines) == n and {x["outcome"] for x in lines} <= set(soak.OUTCOMES)
    assert all(sum(r["by_kind"][k].values()) > 0 for k in soak.KINDS)

    # Every hostile body went out, and each one the server must refuse got a 4xx.
    names = {name for name, *_ in soak.hostile_bodies("m", 512)}
    assert set(r["hostile"]) == names
    for name, h in r["hostile"].items():
        if h["must_reject"]:
            assert set(h["statuses"]) <= {"400", "413"}, (name, h)
        assert not set(h["outcomes"]) & {"http_5xx", "error_event_5xx", "lost"}, (name, h)

    assert r["saturation"]["rate"] > 0 and r["saturation"]["completed_in_window"] > 0
    assert r["outcomes"]["rejected_429"] > 0  # the queue bound held under 8 req/s
    assert r["outcomes"]["completed"] > 0
    v = r["verdict"]
    assert set(v) == {"every_request_ended", "zero_5xx", "zero_lost", "kv_zero_at_end", "memory_flat",
                      "hostile_rejected", "no_connect_errors", "scrapes_ok", "server_alive", "passed"}
    for key in ("every_request_ended", "zero_5xx", "zero_lost", "hostile_rejected", "no_connect_errors",
                "server_alive"):
        assert v[key] is True, (key, r["errors"])
    assert v["memory_flat"] in (True, False) and r["memory"]["host_rss_bytes"]["num_samples"] >= 6

    # The end state the tool reports is the server's own, read back here.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    stats = httpx.get(f"{url}/stats", headers=headers, timeout=10).json()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0 and v["kv_zero_at_end"] is True
    assert r["end_state"]["stats"]["kv_cache_usage"] == 0.0
    metrics_ok = httpx.get(f"{url}/metrics", headers=headers, timeout=10).status_code == 200
    assert v["scrapes_ok"] == metrics_ok == all(s["metrics_ok"] and s["stats_ok"] for s in r["samples"])
    assert all(s["host_rss_bytes"] > 0 and "kv_cache_usage" in s for s in r["samples"])
    out = capsys.readouterr().out
    assert "saturation:" in out and "verdict:" in out and "rejected_429" in out
