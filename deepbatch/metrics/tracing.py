"""OpenTelemetry traces: one ``llm_request`` span per engine request, exported over OTLP.

Off unless an endpoint is given (``deepbatch serve --otlp-traces-endpoint URL``, default
``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); until then nothing imports OpenTelemetry, and the
server makes no span. The packages come with the ``otel`` extra.

A span's parent is the W3C trace context of the HTTP request (``traceparent``, ``tracestate``).
It starts at the request's arrival and ends when the engine finishes it, and carries the GenAI
semantic-convention attributes (the current names, ``gen_ai.usage.input_tokens`` ..., and
vLLM's, ``gen_ai.usage.prompt_tokens`` ...) and the engine's timings, which split the latency
exactly::

    e2e = time_in_queue + time_in_model_prefill + time_in_model_decode
    time_to_first_token = time_in_queue + time_in_model_prefill

The context is taken on the event loop when the request is queued; the span is made on the
engine thread when its final output is out (an engine observer), so requests whose client went
away are traced too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACES_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SPAN_NAME = "llm_request"
INSTALL_HINT = "pip install 'deepbatch[otel]'"


class SpanAttributes:
    # OpenTelemetry GenAI semantic conventions.
    OPERATION_NAME = "gen_ai.operation.name"
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_ID = "gen_ai.response.id"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    # vLLM's names (the older conventions and its own), for tools built on vLLM's traces.
    REQUEST_ID = "gen_ai.request.id"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # How often the scheduler took the request's KV blocks away (swap or recompute).
    USAGE_NUM_PREEMPTIONS = "gen_ai.usage.num_preemptions"


def default_traces_endpoint() -> str | None:
    return os.environ.get(TRACES_ENDPOINT_ENV) or None


def make_tracer_provider(endpoint: str):
    """An SDK ``TracerProvider`` that batches spans to the OTLP collector at ``endpoint``: gRPC
    (plaintext unless the URL is https), or HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
    http/protobuf. Raises ValueError when OpenTelemetry is not installed."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ValueError(f"OTLP traces need the OpenTelemetry SDK ({e}); install it: {INSTALL_HINT}") from None
    exporter = _span_exporter(endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": "deepbatch"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _span_exporter(endpoint: str):
    protocol = os.environ.get(TRACES_PROTOCOL_ENV, "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # As vLLM: collectors are usually reached in plaintext (grpc://host:4317); an https
            # URL still gets TLS.
            return OTLPSpanExporter(endpoint=endpoint, insecure=True)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint)
    except ImportError as e:
        raise ValueError(f"OTLP traces need the OTLP exporter ({e}); install it: {INSTALL_HINT}") from None
    raise ValueError(f"{TRACES_PROTOCOL_ENV}: {protocol!r} is not supported; use grpc or http/protobuf")


@dataclass(frozen=True)
class _Pending:
    context: object  # the parent's opentelemetry Context
    attributes: dict
    max_tokens: int | None  # as asked; None: up to the context length


class RequestTracer:
    """Spans for the requests of one engine. ``pending`` runs on the event loop around queueing
    a request; ``observe`` is an engine output observer (engine thread)."""

    def __init__(self, tracer_provider, max_model_len: int):
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer_provider.get_tracer("deepbatch")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._error_status = partial(Status, StatusCode.ERROR)
        self.max_model_len = max_model_len
        # Engine request id -> what its span needs. Set on the event loop, popped on the engine
        # thread (single dict operations, atomic under the GIL). A request that never gets a final
        # output (the engine died) leaves its entry behind; the server is exiting then.
        self._pending: dict[str, _Pending] = {}

    @contextmanager
    def pending(self, request_ids: list[str], headers: Mapping[str, str], params, *, operation: str,
                request_model: str, response_model: str, response_id: str) -> Iterator[None]:
        """Hold the span data of ``request_ids`` while they are queued (the body of the ``with``);
        if queueing raises, they are dropped. Entered before the requests reach the engine, so a
        request can never finish before its data is there."""
        attributes = {
            SpanAttributes.OPERATION_NAME: operation,
            SpanAttributes.REQUEST_MODEL: request_model,
            SpanAttributes.RESPONSE_MODEL: response_model,
            SpanAttributes.RESPONSE_ID: response_id,
            SpanAttributes.REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.REQUEST_TOP_P: params.top_p,
            SpanAttributes.REQUEST_N: params.n,
            SpanAttributes.REQUEST_CHOICE_COUNT: params.n,
        }
        entry = _Pending(self._propagator.extract(headers), attributes, params.max_tokens)
        held = []
        for request_id in request_ids:
            # An id already in flight keeps its entry: the engine refuses the duplicate.
            if request_id not in self._pending:
                self._pending[request_id] = entry
                held.append(request_id)
        try:
            yield
        except BaseException:
            for request_id in held:
                self._pending.pop(request_id, None)
            raise

    def observe(self, outputs) -> None:
        for out in outputs:
            if out.finished:
                entry = self._pending.pop(out.request_id, None)
                if entry is not None:
                    self._record(out, entry)

    def _record(self, out, entry: _Pending) -> None:
        now, now_ns = time.monotonic(), time.time_ns()
        m = out.metrics
        arrival = m.arrival_time if m is not None and m.arrival_time is not None else now
        finished = m.finished_time if m is not None and m.finished_time is not None else now
        scheduled = m.first_scheduled_time if m is not None else None
        first_token = m.first_token_time if m is not None else None
        num_prompt = len(out.prompt_token_ids)
        num_output = sum(len(c.token_ids) for c in out.outputs)
        attrs = dict(entry.attributes)
        attrs.update({
            SpanAttributes.REQUEST_ID: out.request_id,
            SpanAttributes.REQUEST_MAX_TOKENS: (entry.max_tokens if entry.max_tokens is not None
                                                else self.max_model_len - num_prompt),
            SpanAttributes.USAGE_INPUT_TOKENS: num_prompt,
            SpanAttributes.USAGE_PROMPT_TOKENS: num_prompt,
            SpanAttributes.USAGE_OUTPUT_TOKENS: num_output,
            SpanAttributes.USAGE_COMPLETION_TOKENS: num_output,
            SpanAttributes.USAGE_CACHED_TOKENS: out.num_cached_tokens,
            SpanAttributes.USAGE_NUM_PREEMPTIONS: m.num_preemptions if m is not None else 0,
            SpanAttributes.RESPONSE_FINISH_REASONS: [c.finish_reason or "abort" for c in out.outputs],
            SpanAttributes.LATENCY_E2E: finished - arrival,
        })
        # A phase the request never reached (aborted while waiting, or before its first token)
        # has no attribute.
        if scheduled is not None:
            attrs[SpanAttributes.LATENCY_TIME_IN_QUEUE] = scheduled - arrival
            attrs[SpanAttributes.LATENCY_TIME_IN_MODEL_INFERENCE] = finished - scheduled
            if first_token is not None:
                attrs[SpanAttributes.LATENCY_TIME_TO_FIRST_TOKEN] = first_token - arrival
                attrs[SpanAttributes.LATENCY_TIME_IN_MODEL_PREFILL] = first_token - scheduled
                attrs[SpanAttributes.LATENCY_TIME_IN_MODEL_DECODE] = finished - first_token

        def wall_ns(t: float) -> int:  # engine times are monotonic; spans carry wall-clock times
            return now_ns - int((now - t) * 1e9)

        span = self._tracer.start_span(SPAN_NAME, context=entry.context, kind=self._server_kind,
                                       attributes=attrs, start_time=wall_ns(arrival))
        if out.error:
            span.set_status(self._error_status(out.error))
        span.end(end_time=wall_ns(finished))
