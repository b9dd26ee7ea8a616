"""The SLO controller's gauges and its JSON route, on the real app over a fake engine (no model):
a real scheduler and controller fed simulated steps stand in for the engine's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from apitest_fakes import FakeEngine
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.config import SchedulerConfig
from deepbatch.engine.async_engine import AsyncEngine
from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.control.controller import make_controller
from deepbatch.scheduler.scheduler import Scheduler

A, B, C = 2e-3, 0.05e-3, 0.02e-3  # the simulated step time: a + b * tokens + c * seqs


def fed_controller():
    now = [0.0]
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, slo_ttft_ms=500.0, slo_tpot_ms=20.0)
    sched = Scheduler(cfg, KVCacheManager(256, 16), 4096, clock=lambda: now[0])
    controller = make_controller(sched)
    for i in range(256):
        seqs = 1 + i % 16
        tokens = seqs + (i % 5) * 37  # some steps carry prefill chunks
        dt = A + B * tokens + C * seqs
        now[0] += dt
        first = []
        if i % 4 == 0:  # a first token every fourth step: a load well inside capacity
            r = Request(f"r{i}", [5] * 100, SamplingParams(max_tokens=8), 8, arrival_time=now[0] - 0.05)
            r.first_token_time = now[0]
            first.append(r)
        controller.observe_step(dt, tokens, seqs, first, [])
    return controller


def client_for(fake) -> TestClient:
    return TestClient(build_app(AsyncEngine(fake), ServerConfig(log_stats_interval=0)))


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_gauges_and_route_with_the_controller_on():
    fake = FakeEngine()
    fake.controller = fed_controller()
    with client_for(fake) as client:
        text = client.get("/metrics").text
        seqs = metric(text, "deepbatch:controller_max_num_seqs")
        tokens = metric(text, "deepbatch:controller_max_num_batched_tokens")
        assert 1 <= seqs <= 64 and seqs <= tokens <= 2048
        body = client.get("/v1/controller").json()
    assert body["targets"] == {"ttft_p99_ms": 500.0, "tpot_p99_ms": 20.0}
    assert body["settings"]["max_num_seqs"] == seqs and body["settings"]["max_num_batched_tokens"] == tokens
    model = body["step_time_model"]
    assert model["a_ms"] == pytest.approx(2.0, rel=0.01)
    assert model["b_ms_per_token"] == pytest.approx(0.05, rel=0.01)
    assert model["c_ms_per_seq"] == pytest.approx(0.02, rel=0.05)
    assert body["observed"]["ttft_p99_ms"] == pytest.approx(50.0, rel=0.01)
    assert body["frontier"], "no frontier points"
    for p in body["frontier"]:
        assert set(p) >= {"max_num_seqs", "max_num_batched_tokens", "throughput_rps", "ttft_p99_ms", "tpot_p99_ms",
                          "meets"}
        assert p["throughput_rps"] >= 0 and p["max_num_seqs"] <= 64 and p["max_num_batched_tokens"] <= 2048
    assert any(p["meets"] for p in body["frontier"])


def test_route_and_gauges_with_the_controller_off():
    with client_for(FakeEngine()) as client:
        resp = client.get("/v1/controller")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "controller_off"
        assert "deepbatch:controller_max_num_seqs" not in client.get("/metrics").text
