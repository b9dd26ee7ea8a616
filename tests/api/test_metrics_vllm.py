"""vLLM's request-size, phase-time, per-step and cache-config metrics on ``/metrics``, after real
traffic on a real server, checked against what the clients were sent (usage) and against each
other; vLLM's bucket boundaries; no ``*_created`` series."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient

from apitest_fakes import FakeEngine
from apitest_server import KV_BLOCKS, MAIN_SERVER, MODEL, get_server, parse_metrics
from deepbatch.api.metrics import token_count_buckets
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.engine.async_engine import AsyncEngine

SERVERS = {"main": MAIN_SERVER}
MAX_MODEL_LEN = 512  # the test servers' --max-model-len

# vLLM's definitions (vllm/v1/metrics/loggers.py), written out here as the reference.
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0]
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SIZE_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # 1-2-5 up to max_model_len
HISTOGRAMS = {
    "vllm:time_per_output_token_seconds": TPOT_BUCKETS,
    "vllm:request_prompt_tokens": SIZE_BUCKETS,
    "vllm:request_generation_tokens": SIZE_BUCKETS,
    "vllm:request_prefill_time_seconds": LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": LATENCY_BUCKETS,
    "vllm:iteration_tokens_total": ITERATION_BUCKETS,
}
_LE = re.compile(r'le="([^"]+)"')


@pytest.fixture(scope="module")
def server():
    return get_server("main")


def scrape(server) -> tuple[str, dict[str, float]]:
    with server.http() as http:
        text = http.get("/metrics").text
    return text, parse_metrics(text)


def wait_idle(server, timeout: float = 30.0) -> None:
    """Until no request of an earlier test still runs or waits, so deltas are this test's own."""
    deadline = time.monotonic() + timeout
    while server.metric("vllm:num_requests_running") or server.metric("vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.1)


def series(metrics: dict[str, float], name: str) -> float:
    return metrics.get(f'{name}{{model_name="{MODEL}"}}', 0.0)


def buckets(metrics: dict[str, float], name: str) -> dict[str, float]:
    """``{le: cumulative count}`` of histogram ``name``."""
    return {_LE.search(key).group(1): v for key, v in metrics.items() if key.startswith(name + "_bucket{")}


@pytest.fixture(scope="module")
def traffic(server):
    """Three completions of known sizes and a streamed chat, one after another; the scrapes
    before and after, and each reply's usage."""
    wait_idle(server)
    _, before = scrape(server)
    usages = []
    client = server.client()
    for prompt_len, max_tokens in ((3, 4), (5, 6), (7, 9)):
        out = client.completions.create(model=MODEL, prompt=list(range(100, 100 + prompt_len)), max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        usages.append((out.usage.prompt_tokens, out.usage.completion_tokens))
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream][-1]
    usages.append((usage.prompt_tokens, usage.completion_tokens))
    text, after = scrape(server)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    return text, after, delta, usages


def test_every_name_with_vllms_buckets_and_no_created_series(traffic):
    text, after, _, _ = traffic
    names = {key.split("{")[0] for key in after}
    for name, bounds in HISTOGRAMS.items():
        assert {name + "_bucket", name + "_sum", name + "_count"} <= names, name
        assert list(buckets(after, name)) == [str(float(b)) for b in bounds] + ["+Inf"], name
    assert "vllm:cache_config_info" in names
    assert "_created" not in text


def test_request_sizes_equal_the_usage_clients_were_sent(traffic):
    _, _, delta, usages = traffic
    n = len(usages)
    prompt, generated = sum(p for p, _ in usages), sum(c for _, c in usages)
    assert series(delta, "vllm:request_prompt_tokens_count") == n
    assert series(delta, "vllm:request_prompt_tokens_sum") == prompt == series(delta, "vllm:prompt_tokens_total")
    assert series(delta, "vllm:request_generation_tokens_count") == n
    assert series(delta, "vllm:request_generation_tokens_sum") == generated == \
        series(delta, "vllm:generation_tokens_total")
    succeeded = sum(v for k, v in delta.items() if k.startswith("vllm:request_success_total{"))
    assert succeeded == n


def test_phase_times_add_up_to_the_request_latency(traffic):
    _, _, delta, usages = traffic
    n = len(usages)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_queue_time_seconds",
                 "e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert series(delta, f"vllm:{name}_count") == n, name
    queue, prefill, decode, e2e, ttft = (series(delta, f"vllm:{name}_sum") for name in (
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "e2e_request_latency_seconds", "time_to_first_token_seconds"))
    assert prefill > 0 and decode > 0
    assert queue + prefill + decode == pytest.approx(e2e, abs=1e-6)
    assert queue + prefill == pytest.approx(ttft, abs=1e-6)


def test_time_per_output_token_is_the_interval_between_tokens(traffic):
    _, _, delta, usages = traffic
    intervals = sum(c - 1 for _, c in usages)  # every token but a request's first
    assert series(delta, "vllm:time_per_output_token_seconds_count") == intervals
    assert series(delta, "vllm:time_per_output_token_seconds_count") == \
        series(delta, "vllm:inter_token_latency_seconds_count")
    tpot = series(delta, "vllm:time_per_output_token_seconds_sum")
    assert tpot == pytest.approx(series(delta, "vllm:inter_token_latency_seconds_sum"))
    # The intervals of a request span its decode phase (timed where the engine hands tokens out).
    assert tpot == pytest.approx(series(delta, "vllm:request_decode_time_seconds_sum"), abs=0.05 * len(usages))


def test_iteration_tokens_one_observation_per_step(traffic):
    _, _, delta, usages = traffic
    # One request at a time, one token per step; the step of a request's first token also
    # counts its prompt (vLLM's count).
    steps = [t for prompt, completion in usages for t in [prompt + 1] + [1] * (completion - 1)]
    got = buckets(delta, "vllm:iteration_tokens_total")
    assert got == {str(float(b)): sum(t <= b for t in steps) for b in ITERATION_BUCKETS} | {"+Inf": len(steps)}
    assert series(delta, "vllm:iteration_tokens_total_sum") == sum(steps) == \
        series(delta, "vllm:prompt_tokens_total") + series(delta, "vllm:generation_tokens_total")


def test_cache_config_info_holds_the_servers_settings(traffic):
    _, after, _, _ = traffic
    [(key, value)] = [(k, v) for k, v in after.items() if k.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', key))
    assert value == 1
    assert labels == {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                      "gpu_memory_utilization": "0.9", "num_gpu_blocks": KV_BLOCKS,
                      "num_gpu_blocks_override": KV_BLOCKS, "num_cpu_blocks": "0", "swap_space": "0.0"}


# -- in process, over a fake engine (one token per request per step) ----------------------------------

def test_iteration_tokens_of_a_batch_in_one_step():
    with TestClient(build_app(AsyncEngine(FakeEngine(max_model_len=MAX_MODEL_LEN)),
                              ServerConfig(log_stats_interval=0))) as client:
        resp = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [4, 5, 6, 7, 8]], "max_tokens": 4})
        assert resp.status_code == 200
        text = client.get("/metrics").text
    m = parse_metrics(text)
    # Both prompts reach the engine together: step 1 = 2 tokens + 3 + 5 prompt tokens; 3 more of 2.
    assert series_fake(m, "vllm:iteration_tokens_total_count") == 4
    assert series_fake(m, "vllm:iteration_tokens_total_sum") == 10 + 2 * 3
    assert buckets(m, "vllm:iteration_tokens_total")["1.0"] == 0
    assert buckets(m, "vllm:iteration_tokens_total")["8.0"] == 3
    assert series_fake(m, "vllm:request_generation_tokens_sum") == 8
    assert "vllm:cache_config_info" not in text and "_created" not in text  # no EngineConfig: no info


def series_fake(metrics: dict[str, float], name: str) -> float:
    return metrics[f'{name}{{model_name="fake"}}']


def test_token_count_buckets():
    assert token_count_buckets(MAX_MODEL_LEN) == SIZE_BUCKETS
    assert token_count_buckets(1) == [1]
    assert token_count_buckets(1000)[-3:] == [200, 500, 1000]
