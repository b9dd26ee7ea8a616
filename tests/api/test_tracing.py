"""OpenTelemetry request traces: ``deepbatch serve --otlp-traces-endpoint`` exporting over OTLP/gRPC
to a collector in this process, and the same tracer in process over a fake engine.

Each span is checked against what the client itself saw: its ``traceparent``/``tracestate``, the
reply's id and usage, and the latency it measured around the call."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from apitest_fakes import FakeEngine
from apitest_server import MODEL, REPO, free_port, get_server
from deepbatch import cli
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.engine.async_engine import AsyncEngine
from deepbatch.metrics.tracing import SPAN_NAME, make_tracer_provider

COLLECTOR_PORT = free_port()
# A small KV cache (5 blocks of 16 tokens), so that two requests of 3 blocks preempt each other.
SERVERS = {"traced": dict(
    args=["--num-gpu-blocks-override", "5", "--otlp-traces-endpoint", f"grpc://127.0.0.1:{COLLECTOR_PORT}"],
    env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # export batched spans every 50 ms, not every 5 s
)}

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
A = "gen_ai."
EPS = 1e-6  # latencies are sums of the same float timestamps


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self):
        self.spans = []
        self.resources = []
        self.cond = threading.Condition()

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        with self.cond:
            for resource_spans in request.resource_spans:
                self.resources.append(attributes(resource_spans.resource.attributes))
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait(self, match, count: int = 1, timeout: float = 30.0) -> list:
        """The spans ``match`` accepts, once there are ``count`` of them (and a moment longer, to
        see that no more come)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while len([s for s in self.spans if match(s)]) < count:
                left = deadline - time.monotonic()
                assert left > 0, f"{count} span(s) expected; got {[s.name for s in self.spans if match(s)]}"
                self.cond.wait(left)
        time.sleep(0.3)
        with self.cond:
            found = [s for s in self.spans if match(s)]
        assert len(found) == count, found
        return found


def attributes(kvs) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)
    return {kv.key: value(kv.value) for kv in kvs}


def in_trace(trace_id: str):
    return lambda span: span.trace_id.hex() == trace_id


@pytest.fixture(scope="module")
def collector():
    receiver = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    server.add_insecure_port(f"127.0.0.1:{COLLECTOR_PORT}")
    server.start()
    yield receiver
    server.stop(None)


@pytest.fixture(scope="module")
def server(collector):
    return get_server("traced")


def check_timings(attrs: dict, span, client_latency: float) -> None:
    """The engine's timings split its latency exactly, match the span's own length, and fit in
    what the client measured."""
    queue, prefill, decode = (attrs[A + "latency.time_in_queue"], attrs[A + "latency.time_in_model_prefill"],
                              attrs[A + "latency.time_in_model_decode"])
    e2e, ttft = attrs[A + "latency.e2e"], attrs[A + "latency.time_to_first_token"]
    assert queue >= 0 and prefill > 0 and decode >= 0
    assert abs(ttft - (queue + prefill)) < EPS
    assert abs(e2e - (queue + prefill + decode)) < EPS
    assert abs(attrs[A + "latency.time_in_model_inference"] - (prefill + decode)) < EPS
    assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < EPS
    assert 0 < e2e < client_latency


def test_completion_span_has_the_callers_parent_attributes_and_timings(server, collector):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.7,
            "top_p": 0.9, "seed": 3, "ignore_eos": True}
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "X-Request-Id": "trace-me"}
    sent_ns, start = time.time_ns(), time.perf_counter()
    with server.http() as http:
        resp = http.post("/v1/completions", json=body, headers=headers)
    latency, received_ns = time.perf_counter() - start, time.time_ns()
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    [span] = collector.wait(in_trace(TRACE_ID))
    attrs = attributes(span.attributes)

    assert span.name == SPAN_NAME and span.kind == span.SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == PARENT_ID and span.trace_state == TRACESTATE
    assert span.status.code == span.status.STATUS_CODE_UNSET
    assert reply["id"] == "cmpl-trace-me"
    assert attrs[A + "request.id"] == attrs[A + "response.id"] == reply["id"]
    assert attrs[A + "operation.name"] == "text_completion"
    assert attrs[A + "request.model"] == attrs[A + "response.model"] == reply["model"] == MODEL
    assert attrs[A + "request.max_tokens"] == 12
    assert attrs[A + "request.temperature"] == pytest.approx(0.7) and attrs[A + "request.top_p"] == pytest.approx(0.9)
    assert attrs[A + "request.n"] == attrs[A + "request.choice.count"] == 1
    usage = reply["usage"]
    assert attrs[A + "usage.input_tokens"] == attrs[A + "usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs[A + "usage.output_tokens"] == attrs[A + "usage.completion_tokens"] == usage["completion_tokens"] == 12
    assert attrs[A + "response.finish_reasons"] == [reply["choices"][0]["finish_reason"]] == ["length"]
    assert attrs[A + "usage.num_preemptions"] == 0
    check_timings(attrs, span, latency)
    assert sent_ns <= span.start_time_unix_nano < span.end_time_unix_nano <= received_ns
    assert {"service.name": "deepbatch"}.items() <= collector.resources[-1].items()


def test_streamed_chat_span_matches_the_stream(server, collector):
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    chunks, first_token = [], None
    start = time.perf_counter()
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body,
                                            headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
                if first_token is None and any(c["delta"].get("content") for c in chunks[-1]["choices"]):
                    first_token = time.perf_counter() - start
    latency = time.perf_counter() - start
    [span] = collector.wait(in_trace(trace_id))
    attrs = attributes(span.attributes)
    usage = chunks[-1]["usage"]
    assert attrs[A + "operation.name"] == "chat" and attrs[A + "response.id"] == chunks[0]["id"]
    assert attrs[A + "usage.output_tokens"] == usage["completion_tokens"] > 0
    assert attrs[A + "usage.input_tokens"] == usage["prompt_tokens"]
    check_timings(attrs, span, latency)
    # The engine's first token comes before the client reads it.
    assert attrs[A + "latency.time_to_first_token"] < first_token


def test_request_without_trace_context_gets_a_root_span(server, collector):
    with server.http() as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                         headers={"X-Request-Id": "no-parent"})
    assert resp.status_code == 200
    [span] = collector.wait(lambda s: attributes(s.attributes).get(A + "request.id") == "cmpl-no-parent")
    assert span.parent_span_id == b"" and span.trace_id.hex() != TRACE_ID


def test_one_span_per_prompt_with_n_choices(server, collector):
    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    body = {"model": MODEL, "prompt": [[9690, 2124, 253, 655], [504, 6346, 314]], "n": 2, "max_tokens": 5,
            "temperature": 1.0, "seed": 7}
    with server.http() as http:
        resp = http.post("/v1/completions", json=body, headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01",
                                                               "X-Request-Id": "batch"})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    spans = collector.wait(in_trace(trace_id), count=2)
    by_id = {attributes(s.attributes)[A + "request.id"]: s for s in spans}
    assert set(by_id) == {"cmpl-batch-0", "cmpl-batch-1"}
    for i in range(2):
        span = by_id[f"cmpl-batch-{i}"]
        attrs = attributes(span.attributes)
        assert span.parent_span_id.hex() == PARENT_ID and attrs[A + "response.id"] == "cmpl-batch"
        assert attrs[A + "request.n"] == 2
        mine = [c for c in choices if c["index"] // 2 == i]
        assert attrs[A + "response.finish_reasons"] == [c["finish_reason"] for c in mine]
        assert attrs[A + "usage.input_tokens"] == len(body["prompt"][i])
    total = sum(attributes(s.attributes)[A + "usage.output_tokens"] for s in spans)
    assert total == resp.json()["usage"]["completion_tokens"]


def test_preemptions_are_counted_on_the_preempted_request(server, collector):
    # Two requests of 45 tokens (3 blocks each) in a 5-block cache: one must give its blocks up.
    trace_id = "7bf92f3577b34da6a3ce929d0e0e4739"
    before = server.metric("vllm:num_preemptions_total")

    async def run():
        async with server.async_http() as http:
            return await asyncio.gather(*(http.post("/v1/completions", headers={
                "traceparent": f"00-{trace_id}-{PARENT_ID}-01", "X-Request-Id": f"long-{i}"}, json={
                "model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}) for i in range(2)))

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    preempted = server.metric("vllm:num_preemptions_total") - before
    assert preempted > 0
    spans = collector.wait(in_trace(trace_id), count=2)
    counts = [attributes(s.attributes)[A + "usage.num_preemptions"] for s in spans]
    assert sum(counts) == preempted
    for span in spans:
        attrs = attributes(span.attributes)
        assert attrs[A + "usage.output_tokens"] == 40
        assert abs(attrs[A + "latency.e2e"] - attrs[A + "latency.time_in_queue"]
                   - attrs[A + "latency.time_in_model_prefill"] - attrs[A + "latency.time_in_model_decode"]) < EPS


def test_a_client_that_goes_away_still_gets_its_span(server, collector):
    trace_id = "8bf92f3577b34da6a3ce929d0e0e473a"
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body,
                                            headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # the first token is out; leaving closes the connection
    [span] = collector.wait(in_trace(trace_id))
    attrs = attributes(span.attributes)
    assert attrs[A + "response.finish_reasons"] == ["abort"]
    assert 1 <= attrs[A + "usage.output_tokens"] < 60
    assert span.parent_span_id.hex() == PARENT_ID


# -- in process, over a fake engine ---------------------------------------------------------------------

def traced_app(engine_kwargs=None):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = build_app(AsyncEngine(FakeEngine(**(engine_kwargs or {}))), ServerConfig(log_stats_interval=0), provider)
    return app, exporter


def parent(span) -> str:
    return format(span.parent.span_id, "016x")


def test_refused_requests_leave_no_span_and_no_trace_data():
    app, exporter = traced_app({"step_delay": 0.02, "max_model_len": 64})

    def tp(parent_id: str) -> dict:
        return {"traceparent": f"00-{TRACE_ID}-{parent_id}-01"}

    with TestClient(app) as client:
        running = threading.Thread(target=client.post, args=("/v1/completions",), kwargs=dict(
            json={"prompt": [1, 2], "max_tokens": 25}, headers={**tp("a" * 16), "X-Request-Id": "dup"}))
        running.start()
        time.sleep(0.1)  # it is in flight: the same id is refused, and must not take over its span
        dup = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2},
                          headers={**tp("b" * 16), "X-Request-Id": "dup"})
        too_long = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 100},
                               headers={**tp("c" * 16), "X-Request-Id": "bad"})
        running.join()
        assert dup.status_code == 400 and too_long.status_code == 400
        assert [parent(s) for s in exporter.get_finished_spans()] == ["a" * 16]
        # The refused ids left nothing behind: their next requests carry their own contexts.
        for rid, parent_id in (("dup", "d" * 16), ("bad", "e" * 16)):
            resp = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2},
                               headers={**tp(parent_id), "X-Request-Id": rid})
            assert resp.status_code == 200
    assert [parent(s) for s in exporter.get_finished_spans()] == ["a" * 16, "d" * 16, "e" * 16]
    assert all(s.kind == SpanKind.SERVER for s in exporter.get_finished_spans())


def test_a_malformed_traceparent_starts_a_trace_of_its_own():
    app, exporter = traced_app()
    with TestClient(app) as client:
        for bad in ("garbage", f"00-{'0' * 32}-{PARENT_ID}-01", f"00-{TRACE_ID}-{PARENT_ID}"):
            resp = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}, headers={"traceparent": bad})
            assert resp.status_code == 200, resp.text
    spans = exporter.get_finished_spans()
    assert len(spans) == 3 and all(s.parent is None for s in spans)


_NO_TRACING = """
import sys
sys.path.insert(0, "tests/api")
from fastapi.testclient import TestClient
from apitest_fakes import FakeEngine
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.cli import build_parser
from deepbatch.engine.async_engine import AsyncEngine
assert build_parser().parse_args(["serve"]).otlp_traces_endpoint is None
with TestClient(build_app(AsyncEngine(FakeEngine()), ServerConfig(log_stats_interval=0))) as client:
    resp = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                       headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert resp.status_code == 200, resp.text
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""


def test_no_endpoint_no_opentelemetry_sdk():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _NO_TRACING], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # FastAPI itself imports the OpenTelemetry API; without an SDK every span is a no-op.
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_missing_opentelemetry_fails_before_the_model_loads(how, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)  # as if not installed
    argv = ["serve", "--model", "/nonexistent/model"]
    if how == "flag":
        argv += ["--otlp-traces-endpoint", "grpc://127.0.0.1:1"]
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "grpc://127.0.0.1:1")
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert "pip install 'deepbatch[otel]'" in capsys.readouterr().err


def test_unknown_protocol_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        make_tracer_provider("http://127.0.0.1:1/v1/traces")


def test_http_protobuf_exporter_reaches_the_collector(monkeypatch):
    received = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            received.extend((self.path, s) for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    provider = make_tracer_provider(f"http://127.0.0.1:{receiver.server_port}/v1/traces")
    provider.get_tracer("t").start_span(SPAN_NAME).end()
    provider.shutdown()  # flushes
    receiver.shutdown()
    assert [(path, span.name) for path, span in received] == [("/v1/traces", SPAN_NAME)]
