"""``deepbatch bench serve`` against a fake OpenAI-compatible server whose timing and faults are
known: it streams one chunk per token with fixed sleeps, and records what each request asked for,
so the load generator's counts, latencies and arrival times can be checked against the truth."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deepbatch.bench import serve
from deepbatch.bench.serve_workloads import TENANT_HEAVY, TENANT_LIGHT, arrival_offsets

MODEL = "fake-model"
MAX_MODEL_LEN = 512


@dataclass
class FakeConfig:
    ttft: float = 0.0  # sleep before the first chunk
    itl: float = 0.0  # sleep between chunks
    tokens_per_chunk: int = 1
    usage: bool = True
    # Request number k (0-based, in arrival order) gets the fault when k % every == every - 1.
    slow_every: int = 0
    slow_ttft: float = 0.0
    slow_itl: float = 0.0
    fail_every: int = 0  # HTTP 500 before streaming
    drop_every: int = 0  # the connection is cut mid-stream
    truncate_every: int = 0  # the stream ends cleanly but without [DONE]


@dataclass
class FakeState:
    cfg: FakeConfig = field(default_factory=FakeConfig)
    records: list[dict] = field(default_factory=list)
    active: int = 0
    peak_active: int = 0


STATE = FakeState()
app = FastAPI()


@app.get("/v1/models")
async def models():
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": MAX_MODEL_LEN}]}


def _hit(k: int, every: int) -> bool:
    return every > 0 and k % every == every - 1


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    cfg = STATE.cfg
    k = len(STATE.records)
    fate = ("fail" if _hit(k, cfg.fail_every) else "drop" if _hit(k, cfg.drop_every)
            else "truncate" if _hit(k, cfg.truncate_every) else "slow" if _hit(k, cfg.slow_every) else "ok")
    prompt = body["prompt"]
    rec = {"time": time.perf_counter(), "fate": fate, "user": body.get("user"),
           "tenant_header": request.headers.get("x-tenant-id"), "prompt": prompt,
           "prompt_len": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
           "max_tokens": body["max_tokens"], "stream": body.get("stream"), "model": body.get("model"),
           "include_usage": (body.get("stream_options") or {}).get("include_usage"),
           "ignore_eos": body.get("ignore_eos"), "auth": request.headers.get("authorization")}
    STATE.records.append(rec)
    if fate == "fail":
        return JSONResponse({"error": {"message": "injected", "type": "server_error", "code": 500}}, status_code=500)

    async def stream():
        STATE.active += 1
        STATE.peak_active = max(STATE.peak_active, STATE.active)
        try:
            await asyncio.sleep(cfg.ttft + (cfg.slow_ttft if fate == "slow" else 0.0))
            n, sent = body["max_tokens"], 0
            while sent < n:
                if sent:
                    await asyncio.sleep(cfg.slow_itl if fate == "slow" else cfg.itl)
                if fate == "drop" and sent >= n // 2:
                    raise RuntimeError("injected connection drop")
                step = min(cfg.tokens_per_chunk, n - sent)
                sent += step
                choice = {"index": 0, "text": "x" * step, "finish_reason": "length" if sent == n else None}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
            if fate == "truncate":
                return
            if cfg.usage:
                usage = {"prompt_tokens": rec["prompt_len"], "completion_tokens": n, "total_tokens": rec["prompt_len"] + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            STATE.active -= 1

    return StreamingResponse(stream(), media_type="text/event-stream")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fake(server_url):
    STATE.cfg, STATE.records, STATE.active, STATE.peak_active = FakeConfig(), [], 0, 0
    return STATE


def bench(url: str, *argv: str) -> dict:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return serve.run(p.parse_args(["--base-url", url, "--disable-tqdm", *argv]))


# -- counts and latencies ---------------------------------------------------------------------------


def test_counts_tokens_and_latencies_match_the_server(fake, server_url, capsys):
    fake.cfg = FakeConfig(ttft=0.08, itl=0.02)
    r = bench(server_url, "--num-prompts", "12", "--request-rate", "40", "--random-input-len", "24",
              "--random-output-len", "10", "--random-range-ratio", "0.5", "--api-key", "sk-test")
    recs = fake.records
    assert len(recs) == 12 and r["completed"] == 12 and r["failed"] == 0
    assert r["model"] == MODEL and all(x["model"] == MODEL for x in recs)
    assert all(x["stream"] is True and x["include_usage"] is True and x["ignore_eos"] is True for x in recs)
    assert all(x["auth"] == "Bearer sk-test" for x in recs)
    assert r["total_input_tokens"] == sum(x["prompt_len"] for x in recs)
    assert r["total_output_tokens"] == sum(x["max_tokens"] for x in recs)
    # range ratio 0.5: lengths within [L/2, 3L/2], and not all equal
    assert all(12 <= x["prompt_len"] <= 36 and 5 <= x["max_tokens"] <= 15 for x in recs)
    assert len({x["prompt_len"] for x in recs}) > 1
    assert all(0 <= t < 32000 for x in recs for t in x["prompt"])
    # Latencies: the fake server's sleeps plus a little local overhead (same process, 2 threads).
    assert 80 <= r["median_ttft_ms"] < 80 + 40 and r["p99_ttft_ms"] < 80 + 80
    assert 20 <= r["median_itl_ms"] < 20 + 8
    assert 19 <= r["median_tpot_ms"] < 20 + 8
    per = r["requests"]
    for ttft, e2el, n in zip(per["ttft"], per["e2el"], per["output_tokens"]):
        assert e2el == pytest.approx(ttft + (n - 1) * 0.02, abs=0.05)
    out = capsys.readouterr().out
    assert "Successful requests:                     12" in out
    for label in ("Failed requests:", "Benchmark duration (s):", "Total generated tokens:",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 TTFT (ms):", "Median TPOT (ms):",
                  "P90 ITL (ms):", "Mean E2EL (ms):"):
        assert label in out
    assert "Request goodput" not in out
    assert "=" * 12 + " Serving Benchmark Result " + "=" * 12 in out


@pytest.mark.parametrize("tokens_per_chunk,usage", [(3, True), (1, False)])
def test_output_tokens_from_usage_else_chunks(fake, server_url, tokens_per_chunk, usage):
    fake.cfg = FakeConfig(tokens_per_chunk=tokens_per_chunk, usage=usage)
    r = bench(server_url, "--num-prompts", "5", "--random-input-len", "8", "--random-output-len", "9")
    assert r["completed"] == 5
    assert r["requests"]["output_tokens"] == [9] * 5
    assert all(len(itl) == -(-9 // tokens_per_chunk) - 1 for itl in r["requests"]["itl"])


def test_text_prompts(fake, server_url):
    r = bench(server_url, "--num-prompts", "3", "--prompt-type", "text", "--random-input-len", "20",
              "--random-output-len", "2")
    assert r["completed"] == 3
    assert all(isinstance(x["prompt"], str) and x["prompt_len"] == 20 for x in fake.records)


# -- goodput and failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("slo,slow_are_good", [(["ttft:200"], False), (["tpot:50"], False),
                                               (["ttft:200", "e2el:5000"], False), (["e2el:5000"], True)])
def test_goodput_counts_requests_meeting_every_slo(fake, server_url, slo, slow_are_good, capsys):
    # Every third request is slow: 400 ms to its first token, 100 ms per token after it.
    fake.cfg = FakeConfig(ttft=0.01, itl=0.001, slow_every=3, slow_ttft=0.4, slow_itl=0.1)
    r = bench(server_url, "--num-prompts", "9", "--random-input-len", "4", "--random-output-len", "4",
              "--goodput", *slo)
    slow = sum(x["fate"] == "slow" for x in fake.records)
    assert slow == 3 and r["completed"] == 9
    expected = 9 if slow_are_good else 9 - slow
    assert r["good_requests"] == expected
    assert r["request_goodput"] == pytest.approx(expected / r["duration"])
    assert "Request goodput (req/s):" in capsys.readouterr().out


def test_failures_are_counted_not_raised(fake, server_url):
    fake.cfg = FakeConfig(itl=0.002, fail_every=4, drop_every=5, truncate_every=7)
    r = bench(server_url, "--num-prompts", "30", "--request-rate", "200", "--random-input-len", "4",
              "--random-output-len", "6")
    fates = [x["fate"] for x in fake.records]
    assert len(fates) == 30 and {"fail", "drop", "truncate"} <= set(fates)
    bad = sum(f != "ok" for f in fates)
    assert r["failed"] == bad and r["completed"] == 30 - bad
    assert r["total_output_tokens"] == 6 * (30 - bad)  # partial streams add nothing
    errors = [e for e in r["requests"]["error"] if e]
    assert sum(e.startswith("HTTP 500") for e in errors) == fates.count("fail")
    assert sum("before [DONE]" in e for e in errors) == fates.count("truncate")


def test_timeouts_and_unreachable_server_are_failures(fake, server_url):
    fake.cfg = FakeConfig(ttft=2.0)  # every request would succeed after 2 s without the timeout
    r = bench(server_url, "--num-prompts", "3", "--random-output-len", "2", "--timeout", "0.3")
    assert r["failed"] == 3 and all("timeout" in e for e in r["requests"]["error"])
    r = bench(f"http://127.0.0.1:{_free_port()}", "--model", MODEL, "--num-prompts", "2")
    assert r["failed"] == 2 and r["completed"] == 0


# -- arrivals and concurrency --------------------------------------------------------------------------


def test_arrival_schedule_is_seeded_and_has_the_right_rate():
    a = arrival_offsets(20000, 50.0, 1.0, np.random.default_rng(3))
    b = arrival_offsets(20000, 50.0, 1.0, np.random.default_rng(3))
    c = arrival_offsets(20000, 50.0, 1.0, np.random.default_rng(4))
    assert np.array_equal(a, b) and not np.array_equal(a, c) and a[0] == 0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    regular = np.diff(arrival_offsets(20000, 50.0, 4.0, np.random.default_rng(3)))
    assert regular.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape 4: CV 1/2
    assert not arrival_offsets(5, float("inf"), 1.0, np.random.default_rng(0)).any()


def test_requests_leave_on_the_seeded_schedule(fake, server_url):
    argv = ["--num-prompts", "25", "--request-rate", "25", "--random-input-len", "4", "--random-output-len", "2"]

    def run(seed: str) -> tuple[np.ndarray, np.ndarray]:
        """When the generator sent each request, and when the server saw it, from the first."""
        fake.records.clear()
        r = bench(server_url, *argv, "--seed", seed)
        seen = np.sort([x["time"] for x in fake.records])
        return np.array(r["requests"]["send_s"]), seen - seen[0]

    # How late a request leaves depends on the machine's load, so only what holds under any load
    # is asserted: none leaves before its time on the seed's schedule (the event loop may wake
    # a clock tick early), every one reaches the server, and the seed changes the schedule.
    for seed in ("7", "7", "8"):
        expected = arrival_offsets(25, 25.0, 1.0, np.random.default_rng(int(seed)))
        sent, seen = run(seed)
        assert (sent >= expected - 0.005).all(), (seed, sent - expected)
        assert len(seen) == 25
    assert not np.array_equal(arrival_offsets(25, 25.0, 1.0, np.random.default_rng(7)),
                              arrival_offsets(25, 25.0, 1.0, np.random.default_rng(8)))


def test_burst_doubles_the_rate_inside_its_window_only():
    from deepbatch.bench.serve_workloads import build_requests

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--workload", "burst", "--num-prompts", "6000", "--random-input-len", "4",
                         "--random-output-len", "2", "--burst-start-s", "100", "--burst-duration-s", "50"])
    reqs = build_requests(args, 10.0)
    t = np.array([r.arrival_s for r in reqs])
    assert (np.diff(t) >= 0).all()
    before, inside = ((t >= 20) & (t < 100)).sum() / 80, ((t >= 100) & (t < 150)).sum() / 50
    after = ((t >= 150) & (t < 400)).sum() / 250
    assert before == pytest.approx(10, rel=0.15) and after == pytest.approx(10, rel=0.1)
    assert inside == pytest.approx(20, rel=0.15)
    assert {r.group for r in reqs if 100 <= r.arrival_s < 150} == {"burst"}
    assert {r.group for r in reqs if not 100 <= r.arrival_s < 150} == {"steady"}
    # The same prompts as the steady workload at the same seed: only the times move.
    args.workload = "random"
    plain = build_requests(args, 10.0)
    assert [r.prompt for r in plain] == [r.prompt for r in reqs]
    # The window takes 2 x 50 s of the steady stream's arrivals in 50 s: the run ends 50 s sooner.
    assert t[-1] == pytest.approx(plain[-1].arrival_s - 50 * (2 - 1), rel=1e-9)


def test_client_processes_send_the_same_requests_on_one_schedule(fake, server_url):
    fake.cfg = FakeConfig(itl=0.01)
    argv = ["--num-prompts", "30", "--request-rate", "10", "--random-input-len", "6", "--random-output-len", "4",
            "--random-range-ratio", "0.5", "--seed", "7", "--max-concurrency", "30"]
    one = bench(server_url, *argv)
    fake.records.clear()
    fake.peak_active = 0
    three = bench(server_url, *argv, "--num-client-processes", "3")
    assert three["completed"] == 30 and three["failed"] == 0 and len(fake.records) == 30
    # The results come back in the run's order: request i is the same request either way.
    for key in ("prompt_len", "output_len", "output_tokens", "group"):
        assert three["requests"][key] == one["requests"][key], key
    assert len(set(one["requests"]["prompt_len"])) > 1
    # One schedule for all three processes: request i leaves at its seeded offset (3 s in all).
    # The dealing and the common start are held exactly by the next test; this bound only catches
    # a gross error, such as a process that ran its share from its own start (seconds apart on two
    # cores): three client processes, the server and the test share two cores, and a loaded
    # machine delays single sends by tenths of a second.
    expected = arrival_offsets(30, 10.0, 1.0, np.random.default_rng(7))
    sent = np.array(three["requests"]["send_s"])
    assert np.abs(sent - sent[0] - expected).max() < 1.5
    seen = np.sort([x["time"] for x in fake.records])
    assert np.abs(seen - seen[0] - expected).max() < 1.5
    assert three["max_concurrency"] == 30 and fake.peak_active <= 30


def test_shards_are_dealt_round_robin_with_one_start_and_their_own_offsets(monkeypatch):
    """``run_sharded`` without processes or clocks: every shard gets the same start instant and
    its requests as the run has them (their offsets from the run's start, not re-based to the
    shard's first), and the results come back in the run's order."""
    from concurrent.futures import Future

    from deepbatch.bench import serve_clients

    submitted = []

    class InlinePool:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, shard, model, part, start_at):
            assert fn is serve_clients._shard_main and shard.disable_tqdm and shard.max_concurrency == 4
            submitted.append((part, start_at))
            done = Future()
            done.set_result(([("result", r) for r in part], 10.0 + len(submitted)))
            return done

    monkeypatch.setattr(serve_clients, "ProcessPoolExecutor", InlinePool)
    reqs = [argparse.Namespace(arrival_s=0.1 * i) for i in range(10)]
    args = argparse.Namespace(max_concurrency=10, disable_tqdm=False)
    results, duration = serve_clients.run_sharded(args, MODEL, reqs, 3)
    assert [part for part, _ in submitted] == [reqs[0::3], reqs[1::3], reqs[2::3]]
    assert len({start for _, start in submitted}) == 1
    assert results == [("result", r) for r in reqs] and duration == 13.0


def test_a_shard_waits_for_the_common_start(monkeypatch):
    from contextlib import asynccontextmanager

    from deepbatch.bench import serve_clients

    started = []

    @asynccontextmanager
    async def client(args):
        yield None

    async def run_requests(client, model, reqs, args):
        started.append(time.time())
        return reqs, 0.0

    monkeypatch.setattr(serve_clients, "make_client", client)
    monkeypatch.setattr(serve_clients, "run_requests", run_requests)
    start_at = time.time() + 0.3
    assert serve_clients._shard_main(argparse.Namespace(), MODEL, [1, 2], start_at) == ([1, 2], 0.0)
    assert started[0] >= start_at


def test_max_concurrency_limits_requests_in_flight(fake, server_url, capsys):
    fake.cfg = FakeConfig(itl=0.03)
    r = bench(server_url, "--num-prompts", "12", "--max-concurrency", "3", "--random-output-len", "5")
    assert r["completed"] == 12 and fake.peak_active == 3
    # Each request streams for >= 120 ms. Its clock starts when it gets a seat, so the wait for a
    # seat is not counted as TTFT (as in vLLM).
    sends = sorted(r["requests"]["send_s"])
    assert sends[2] < 0.05 and sends[3] > 0.12
    assert np.median(r["requests"]["ttft"]) < 0.08
    assert "Maximum request concurrency:" in capsys.readouterr().out
    fake.peak_active = 0
    bench(server_url, "--num-prompts", "12", "--random-output-len", "5")
    assert fake.peak_active == 12  # rate inf, no limit: all at once


# -- workloads -------------------------------------------------------------------------------------------


def test_tenants_send_ten_to_one(fake, server_url, capsys):
    r = bench(server_url, "--workload", "tenants", "--num-prompts", "55", "--request-rate", "300",
              "--random-input-len", "4", "--random-output-len", "4")
    users = [x["user"] for x in fake.records]
    assert users.count(TENANT_HEAVY) == 50 and users.count(TENANT_LIGHT) == 5
    assert all(x["tenant_header"] == x["user"] for x in fake.records)
    assert users[:50] != [TENANT_HEAVY] * 50  # interleaved, not one tenant after the other
    groups = r["groups"]
    assert groups[TENANT_HEAVY]["output_token_share"] == pytest.approx(50 / 55)
    assert groups[TENANT_LIGHT]["output_token_share"] == pytest.approx(5 / 55)
    out = capsys.readouterr().out
    assert f"{TENANT_LIGHT} token share (%):" in out and f"{TENANT_HEAVY} P99 TTFT (ms):" in out


def test_hol_mixes_long_prompts_into_short_traffic(fake, server_url, capsys):
    fake.cfg = FakeConfig(itl=0.005)
    r = bench(server_url, "--workload", "hol", "--num-prompts", "20", "--request-rate", "20",
              "--hol-short-input-len", "8", "--hol-short-output-len", "4", "--hol-long-every", "0.3")
    lens = [x["prompt_len"] for x in fake.records]
    long_len = MAX_MODEL_LEN - 16  # 32768 capped by the server's max_model_len, room for its output
    assert lens.count(8) == 20 and lens.count(long_len) >= 2 and len(lens) == 20 + lens.count(long_len)
    long_times = [x["time"] for x in fake.records if x["prompt_len"] == long_len]
    short_times = [x["time"] for x in fake.records if x["prompt_len"] == 8]
    assert min(short_times) < min(long_times) and max(long_times) < max(short_times)
    assert r["groups"]["short"]["completed"] == 20
    assert r["groups"]["short"]["p99_itl_ms"] >= 5
    out = capsys.readouterr().out
    assert "Short P99 ITL (ms):" in out and "Head-of-line Blocking" in out


def test_sweep_writes_json_and_plot(fake, server_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--num-prompts", "6", "--random-output-len", "3", "--sweep-rates", "20,inf", "--goodput", "ttft:1000",
            "--output-json", str(out_json)]
    if _has_matplotlib():
        argv += ["--plot", str(out_png)]
    r = bench(server_url, *argv)
    assert [run["request_rate"] for run in r["sweep"]] == [20.0, float("inf")]
    assert len(fake.records) == 12 and all(run["completed"] == 6 for run in r["sweep"])
    saved = json.loads(out_json.read_text())
    assert [run["request_rate"] for run in saved["sweep"]] == [20.0, "inf"]
    assert saved["sweep"][0]["good_requests"] == 6
    assert "Rate Sweep" in capsys.readouterr().out
    if _has_matplotlib():
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    # matplotlib is an optional extra: without it the sweep still runs and writes its JSON.
    return importlib.util.find_spec("matplotlib") is not None


def test_bad_flags_are_rejected(server_url):
    for argv in (["--goodput", "ttft"], ["--goodput", "latency:5"], ["--sweep-rates", "1,x"],
                 ["--plot", "x.png"], ["--num-prompts", "0"], ["--num-client-processes", "0"]):
        with pytest.raises(ValueError):
            bench(server_url, *argv)
