"""The live dashboard at ``/dashboard``.

- in process: the request window's percentiles against numpy's, its tenant shares and expiry;
  the page and its files served without a key, its data only with one;
- in headless Chromium (Debian's ``chromium``, driven over the DevTools protocol on a pipe) against
  a real ``deepbatch serve``: the page asks for the key, goes live, and after traffic its charts
  hold points whose values match what the clients were sent, with no console errors; it shows
  "reconnecting" while the server is down and picks up the restarted one on the same port.
  Screenshots are kept under pytest's tmp dir (the path is printed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

import apitest_server
from apitest_fakes import FakeEngine
from apitest_server import API_KEY, MODEL, ServerProcess, assert_error, get_server
from apitest_chromium import Chromium, find_chromium
from deepbatch.api import dashboard
from deepbatch.api.dashboard import STATIC_DIR, static_routes
from deepbatch.api.dashboard_stats import MAX_TENANTS, OTHER_TENANT, DashboardStats
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.engine.async_engine import AsyncEngine
from deepbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

CHROMIUM = find_chromium()
NO_BROWSER = "Debian's chromium is not installed (scripts/install.sh installs it where apt-get is available)"
# The SLO controller on, so the page has settings and a frontier to show; speculative decoding
# on, so it has a draft acceptance to show.
SERVER = dict(args=["--num-gpu-blocks-override", "256", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "500",
                    "--speculative-config", '{"method": "ngram", "prompt_lookup_min": 1}'],
              api_key=API_KEY)
SERVERS = {"dashboard": SERVER} if CHROMIUM else {}  # only the browser tests use it


# -- the request window, in process -------------------------------------------------------------------


def output(rid, tokens, arrival, first=None, finished_at=None, reason=None, tenant="default", error=None):
    done = finished_at is not None
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "", [5] * tokens, reason if done else None)],
                         finished=done, error=error, metrics=RequestMetrics(arrival, arrival, first, finished_at),
                         tenant=tenant)


def test_window_percentiles_and_shares_match_an_independent_count():
    now = [1000.0]
    stats = DashboardStats(window_s=60, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    ttfts, tpots, tokens_by_tenant = [], [], {}
    for i in range(200):
        arrival, ttft, n = now[0], float(rng.uniform(0.01, 2.0)), int(rng.integers(1, 30))
        decode = float(rng.uniform(0.005, 0.2)) * (n - 1)
        tenant = ["acme", "beta", "gamma"][i % 3]
        stats.observe([output(f"r{i}", 1, arrival, first=arrival + ttft, tenant=tenant)])
        now[0] += 0.1
        stats.observe([output(f"r{i}", n, arrival, arrival + ttft, arrival + ttft + decode, "length", tenant)])
        ttfts.append(ttft)
        if n >= 2:
            tpots.append(decode / (n - 1))
        tokens_by_tenant[tenant] = tokens_by_tenant.get(tenant, 0) + n
    r = stats.report()
    assert r["ttft_ms"]["samples"] == 200 and r["tpot_ms"]["samples"] == len(tpots)
    for key, values in (("ttft_ms", ttfts), ("tpot_ms", tpots)):
        for p in (50, 99):
            assert r[key][f"p{p}"] == pytest.approx(1000 * np.percentile(values, p), rel=1e-9)
    total = sum(tokens_by_tenant.values())
    assert {t["tenant"]: t["generation_tokens"] for t in r["tenants"]} == tokens_by_tenant
    assert {t["tenant"]: t["share"] for t in r["tenants"]} == pytest.approx(
        {k: v / total for k, v in tokens_by_tenant.items()})
    assert r["num_requests_finished"] == 200
    now[0] += 61  # past the window: nothing is left to report
    r = stats.report()
    assert r["ttft_ms"] == {"p50": None, "p99": None, "samples": 0} and r["tenants"] == []


def test_only_completed_requests_of_two_tokens_or_more_have_a_tpot():
    stats = DashboardStats(clock=lambda: 10.0)
    stats.observe([output("one", 1, 1.0, 1.5, 1.5, "length"), output("abort", 5, 1.0, 1.5, 3.0, "abort"),
                   output("err", 5, 1.0, 1.5, 3.0, "length", error="detokenization failed"),
                   output("ok", 3, 1.0, 1.5, 2.5, "stop")])
    r = stats.report()
    assert r["ttft_ms"]["samples"] == 4
    assert r["tpot_ms"] == {"p50": 500.0, "p99": 500.0, "samples": 1}  # (2.5 - 1.5) / (3 - 1)


def test_tenant_names_past_the_cap_count_as_other():
    stats = DashboardStats(clock=lambda: 10.0)
    stats.observe([output(f"r{i}", 1, 1.0, 1.5, tenant=f"t{i}") for i in range(MAX_TENANTS + 20)])
    tenants = {t["tenant"]: t["generation_tokens"] for t in stats.report()["tenants"]}
    assert len(tenants) == MAX_TENANTS + 1 and tenants[OTHER_TENANT] == 20


# -- the page and its data, in process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def app_client():
    engine = AsyncEngine(FakeEngine())
    with TestClient(build_app(engine, ServerConfig(api_key=API_KEY, log_stats_interval=0))) as client:
        yield client


def test_page_and_its_files_need_no_key_and_load_nothing_from_outside(app_client):
    page = app_client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith(("/dashboard/static/", "data:")) for r in refs)
    for ref in (r for r in refs if not r.startswith("data:")):
        resp = app_client.get(ref)
        assert resp.status_code == 200 and resp.content == (STATIC_DIR / ref.removeprefix("/dashboard/static/")).read_bytes()
        assert resp.headers["content-type"].split(";")[0] in ("text/javascript", "text/css")
    assert app_client.head("/dashboard").content == b""


def test_the_data_and_everything_else_still_need_the_key(app_client):
    assert_error(app_client.get("/dashboard/stats"), 401, code="invalid_api_key")
    assert_error(app_client.post("/dashboard"), 401, code="invalid_api_key")
    for path in ("/dashboard/static/../dashboard.py", "/dashboard/static/missing.js", "/dashboard/"):
        assert_error(app_client.get(path), 401, code="invalid_api_key")
    ds = app_client.get("/dashboard/stats", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert ds["model"] == "fake" and ds["controller"] is False and ds["num_generation_tokens"] == 0
    assert set(static_routes()) >= {"/dashboard", "/dashboard/static/dashboard.js"}


def test_a_package_without_its_page_still_serves_the_api(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(dashboard, "STATIC_DIR", tmp_path)  # as a wheel built without package data
    with TestClient(build_app(AsyncEngine(FakeEngine()), ServerConfig(log_stats_interval=0))) as client:
        assert_error(client.get("/dashboard"), 404)
        assert client.get("/stats").status_code == 200 and client.get("/dashboard/stats").status_code == 200
    assert "the dashboard's files are missing" in caplog.text


def test_the_vendored_chart_library_is_the_one_its_source_file_names():
    vendor = STATIC_DIR / "vendor" / "uplot"
    assert "MIT License" in (vendor / "LICENSE").read_text()
    for line in (vendor / "SOURCE").read_text().splitlines():
        if line.startswith("sha256 "):
            _, name, digest = line.split()
            assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name


# -- in the browser, against a real server ------------------------------------------------------------

browser_only = pytest.mark.skipif(CHROMIUM is None, reason=NO_BROWSER)
CLIENTS = {"alpha": 4, "beta": 2}  # requests per wave
MAX_TOKENS = 40
# The controller decides every 64 steps, from the arrivals of its last 10 s: arrivals spread over
# each wave keep one inside that window whatever the step time of a loaded CI machine.
STAGGER_S = 0.5
MAX_WAVES = 8


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dashboard-screenshots")
    print(f"\ndashboard screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium-profile")) as browser:
        yield browser


def state(page) -> str:
    return page.js("document.getElementById('status').dataset.state")


def series(page, name: str) -> list:
    return page.js(f"window.deepbatchDashboard.history[{json.dumps(name)}]")


def unexpected_errors(page, allowed=()) -> list[str]:
    """Console errors, uncaught exceptions and failed loads, less those matching ``allowed``."""
    return [e for e in page.errors() if not any(re.search(a, e) for a in allowed)]


async def traffic(server, until=None) -> dict[str, int]:
    """Waves of requests from two tenants, each request sent ``STAGGER_S`` after the one before,
    until ``until(http)`` holds (or one wave without it); the completion tokens each tenant was
    sent."""
    sent = dict.fromkeys(CLIENTS, 0)
    order = [t for k in range(max(CLIENTS.values())) for t, n in CLIENTS.items() if k < n]
    async with server.async_http() as http:
        async def one(tenant: str, delay: float) -> None:
            await asyncio.sleep(delay)
            resp = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "The dashboard shows", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "user": tenant})
            assert resp.status_code == 200, resp.text
            sent[tenant] += resp.json()["usage"]["completion_tokens"]

        for _ in range(MAX_WAVES):
            await asyncio.gather(*(one(t, STAGGER_S * k) for k, t in enumerate(order)))
            if until is None or await until(http):
                break
    return sent


async def controller_decided(http) -> bool:
    """The SLO controller has a frontier: a decision ran with arrivals inside its window."""
    return bool((await http.get("/v1/controller")).json()["frontier"])


# The 401s before the key is entered, and the failed polls while the server is down.
BEFORE_KEY = [r"status of 401 .*(/stats|/dashboard/stats)"]
SERVER_DOWN = [r"ERR_CONNECTION_REFUSED", r"ERR_EMPTY_RESPONSE", r"ERR_CONNECTION_RESET", r"status of 503"]


@browser_only
def test_page_asks_for_the_key_then_goes_live(page):
    server = get_server("dashboard")
    page.open(f"{server.url}/dashboard")
    page.wait_for(lambda: state(page) == "key", what="the key prompt")
    assert page.js("getComputedStyle(document.getElementById('key-form')).display") != "none"
    page.js(f"document.getElementById('key-input').value = {json.dumps(API_KEY)};"
            "document.querySelector('#key-form button[type=submit]').click()")
    page.wait_for(lambda: state(page) == "live", what="the page to go live")
    assert page.js("getComputedStyle(document.getElementById('key-form')).display") == "none"
    assert page.js(f"localStorage.getItem('deepbatch.apiKey') === {json.dumps(API_KEY)}")
    assert page.js("document.getElementById('model').textContent") == MODEL
    assert unexpected_errors(page, BEFORE_KEY) == []


@browser_only
def test_charts_hold_the_traffic_the_clients_were_sent(page, shots):
    server = get_server("dashboard")
    started = time.monotonic()
    sent = asyncio.run(traffic(server, until=controller_decided))
    total = sum(sent.values())
    num_requests = total // MAX_TOKENS
    assert total % (sum(CLIENTS.values()) * MAX_TOKENS) == 0
    page.wait_for(lambda: page.js("document.getElementById('t-gen-total').dataset.value") == str(total),
                  what="the page to count every token sent")
    # The traffic is over, so what the server reports now stays; the page shows it within a poll.
    ds = server.http().get("/dashboard/stats").json()
    report = server.http().get("/v1/controller").json()
    ttft_text = f"{ds['ttft_ms']['p50']:.1f} / {ds['ttft_ms']['p99']:.1f}"
    page.wait_for(lambda: page.js("document.getElementById('t-ttft').textContent") == ttft_text
                  and page.js("document.getElementById('frontier').dataset.rows") == str(len(report["frontier"])),
                  what="the page to show the last report")
    spec = server.http().get("/stats").json()["spec_decode"]
    assert spec["num_drafts"] > 0, spec
    page.wait_for(lambda: not page.js("document.getElementById('tile-spec').hidden")
                  and page.js("document.getElementById('t-spec').textContent") != "-", what="the draft acceptance")
    length, rate = page.js("document.getElementById('t-spec').textContent").removesuffix(" %").split(" / ")
    assert float(length) == pytest.approx(spec["mean_acceptance_length"], abs=0.005 + 1e-9)
    assert float(rate) == pytest.approx(100 * spec["acceptance_rate"], abs=0.5 + 1e-9)

    points = {c: json.loads(page.js(f"document.getElementById('{c}').dataset.series"))
              for c in ("c-requests", "c-kv", "c-throughput", "c-ttft", "c-tpot", "c-controller")}
    assert all(n >= 3 for per in points.values() for n in per.values()), points
    assert max(v for v in series(page, "running") if v is not None) >= 1
    assert max(v for v in series(page, "kvUsage") if v is not None) > 0
    # Tokens flowed at some rate while the traffic ran, and a rate is never negative.
    gen = series(page, "genTps")
    assert max(v for v in gen if v is not None) > 0 and min(v for v in gen if v is not None) >= 0

    shares = page.js("Object.fromEntries([...document.querySelectorAll('#tenants tbody tr')]"
                     ".map(r => [r.dataset.tenant, Number(r.dataset.share)]))")
    assert shares == pytest.approx({t["tenant"]: t["share"] for t in ds["tenants"]})
    # Against the clients' own counts while every request is still inside the window (a slow,
    # loaded machine can take longer than the window to get the controller to a decision).
    if time.monotonic() - started < ds["window_s"] - 2:
        metrics = server.metrics()
        ttft_count = metrics[apitest_server.metric_key("vllm:time_to_first_token_seconds_count", {"model_name": MODEL})]
        assert ds["ttft_ms"]["samples"] == ttft_count == num_requests
        assert ds["tpot_ms"]["samples"] == num_requests
        assert shares == pytest.approx({t: n / total for t, n in sent.items()})
    else:
        print(f"\nthe traffic outlasted the {ds['window_s']} s window: window counts not compared with the clients'")

    assert page.js("document.getElementById('controller').dataset.state") == "on"
    assert report["frontier"], report["last_decision"]
    current = page.js("[...document.querySelectorAll('#frontier tr.current td')].slice(0, 2).map(c => c.textContent)")
    assert current == [str(report["settings"]["max_num_seqs"]), str(report["settings"]["max_num_batched_tokens"])]
    assert series(page, "ctlSeqs")[-1] == report["settings"]["max_num_seqs"]

    shot = page.screenshot(shots / "after-traffic.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    assert unexpected_errors(page, BEFORE_KEY) == []


@browser_only
def test_page_reconnects_when_the_server_restarts_on_the_same_port(page, shots, monkeypatch):
    old = get_server("dashboard")
    first_id = page.js("document.getElementById('status').dataset.serverId")
    # SIGTERM with a request in flight: the server drains it (and the page says so), then exits.
    in_flight = threading.Thread(target=lambda: old.http().post("/v1/completions", json={
        "model": MODEL, "prompt": "A long answer", "max_tokens": 100, "ignore_eos": True}))
    in_flight.start()
    page.wait_for(lambda: (series(page, "running")[-1] or 0) >= 1, what="the request to run")
    old.terminate()
    page.wait_for(lambda: state(page) == "draining", what="the page to show the drain")
    in_flight.join(60)
    assert old.proc.wait(60) == 0
    page.wait_for(lambda: state(page) == "reconnecting", what="the page to say it is reconnecting")
    down = len(series(page, "t"))
    monkeypatch.setattr(apitest_server, "free_port", lambda: old.port)
    new = ServerProcess("dashboard-restarted", **SERVER)
    try:
        new.wait_ready()
        page.wait_for(lambda: state(page) == "live", what="the page to reconnect")
        status = page.js("({...document.getElementById('status').dataset})")
        assert status["restarts"] == "1" and status["serverId"] != first_id
        assert None in series(page, "running")[down - 1:]  # the outage is a gap in the charts
        sent = asyncio.run(traffic(new))
        page.wait_for(lambda: page.js("document.getElementById('t-gen-total').dataset.value")
                      == str(sum(sent.values())), what="the page to count the new server's tokens")
        # The counters restarted from zero: no negative (or any) rate was taken across the restart.
        assert min(v for v in series(page, "genTps") if v is not None) >= 0
        assert len(series(page, "t")) > down
        page.screenshot(shots / "after-restart.png")
        assert unexpected_errors(page, BEFORE_KEY + SERVER_DOWN) == []
    finally:
        new.stop()
        new.log.close()
        new.out.close()
