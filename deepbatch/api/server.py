"""The OpenAI-compatible HTTP server: app factory, auth, request gate, routes, graceful drain.

    uvicorn (event loop)  --  Gate  --  FastAPI routes  --  OpenAIServing  --  EngineClient
                                                                                 |
                       the engine core process (core_client.py), or a thread of this one (async_engine.py)

Lifecycle (exit statuses in ``EXIT_*``):
- start: the model loads before the port opens, so a reachable /health means ready;
- SIGTERM / SIGINT: drain. /health and every /v1 route answer 503, in-flight requests run until
  ``shutdown_timeout``, the rest end with finish_reason "abort", then the process exits 0;
- a second SIGTERM / SIGINT during the drain: the engine stops after the step in progress, every
  in-flight request ends with an error (a stream with an error event and ``[DONE]``), and once
  those replies are written (or after ``_FORCED_FLUSH_S``) the process exits 3;
- a failed model step: in-flight requests get an error, /health answers 503, and after a short
  grace (so health checkers see the 503) the process exits 1;
- SIGHUP: reload ``--api-keys-file`` (a malformed file keeps the keys in force).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import deepbatch
from deepbatch.api.auth import load_keys
from deepbatch.api.chat_output import load_parsers
from deepbatch.api.chat_template import install_chat_template
from deepbatch.api.dashboard import install_dashboard
from deepbatch.api.errors import APIError, ContainErrors, install_error_handlers
from deepbatch.api.gate import Gate, reload_keys
from deepbatch.api.metrics import ServerMetrics, engine_stats, log_stats_periodically
from deepbatch.api.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ModelCard,
    ModelList,
)
from deepbatch.api.openapi import (
    HealthStatus, add_request_schemas, error_responses, generation_reply, request_body,
)
from deepbatch.api.request_body import body_parser
from deepbatch.api.serving import OpenAIServing
from deepbatch.api.server_config import EXIT_ENGINE_DEAD, EXIT_FORCED, EXIT_OK, ServerConfig, ServerState
from deepbatch.api.serving_tokenize import TOKENIZE_MODELS, add_tokenize_routes
from deepbatch.engine.engine_client import EngineClient
from deepbatch.metrics.tracing import RequestTracer

logger = logging.getLogger("deepbatch.server")

# Seconds an idle keep-alive connection stays open (see run_server).
_KEEP_ALIVE_S = 65

# How long a dead server keeps answering 503 before it exits, so health checks can see it.
_DEAD_EXIT_GRACE_S = 2.0
# After a second signal, longest the error replies of in-flight requests may take to be written
# before the connections are cut (a client that stops reading must not hold the exit up).
_FORCED_FLUSH_S = 5.0


def add_generation_routes(app: FastAPI, serving: OpenAIServing, keys_on: bool, per_key: bool,
                          max_request_body_bytes: int) -> dict:
    """``POST /v1/completions`` and ``/v1/chat/completions`` on ``serving`` (the single-process
    server's and the Ray Serve ingress's); returns the error responses of a key-gated route, for
    the caller's other routes. ``per_key``: keys carry priority ceilings and in-flight limits."""
    # Each route lists the errors it can answer, so clients and fuzzers can hold replies to them.
    auth = 401 if keys_on else 0
    gated = error_responses(auth, 429 if per_key else 0)
    generate = error_responses(400, auth, 403 if per_key else 0, 404, 413, 429, 500, 503)
    parse = body_parser(max_request_body_bytes)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses={**generation_reply(CompletionResponse), **generate})
    async def completions(request: Request) -> Response:
        return await serving.completions(await parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses={**generation_reply(ChatCompletionResponse), **generate})
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await parse(request, ChatCompletionRequest), request)

    return gated


def build_app(engine: EngineClient, config: ServerConfig, tracer_provider=None) -> FastAPI:
    """``tracer_provider``: an OpenTelemetry TracerProvider that gets one span per request (see
    deepbatch/metrics/tracing.py); None traces nothing."""
    names = list(config.served_model_names) or [engine.model_name]
    state = ServerState(keys=load_keys(config.api_keys_file, config.api_key))
    tracer = None
    if tracer_provider is not None:
        tracer = RequestTracer(tracer_provider, engine.max_model_len)
        engine.add_observer(tracer.observe)
    if config.chat_template is not None:
        install_chat_template(engine.tokenizer, config.chat_template)
    parsers = load_parsers(config.tool_call_parser, config.reasoning_parser, config.enable_auto_tool_choice,
                           engine.tokenizer)
    serving = OpenAIServing(engine, names, tracer, parsers)
    metrics = ServerMetrics(engine, names[0], max_model_len=engine.max_model_len,
                            cache_info=engine.cache_info)

    def on_engine_dead(error) -> None:  # on the event loop
        state.exit_code = EXIT_ENGINE_DEAD
        logger.error("the engine is dead (%s); exiting in %.0f s", error, _DEAD_EXIT_GRACE_S)

        async def exit_later() -> None:
            await asyncio.sleep(_DEAD_EXIT_GRACE_S)
            if state.server is not None:
                state.server.should_exit = True

        state.spawn(exit_later())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        engine.add_dead_callback(lambda error: _call_soon(state.loop, on_engine_dead, error))
        engine.start()
        if config.log_stats_interval > 0:
            state.spawn(log_stats_periodically(engine, config.log_stats_interval))
        yield
        for task in list(state.tasks):
            task.cancel()
        engine.shutdown()

    app = FastAPI(title="deepbatch", version=deepbatch.__version__, lifespan=lifespan)
    app.state.server_state = state
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(Gate, engine=engine, state=state)
    gated = add_generation_routes(app, serving, state.keys is not None, config.api_keys_file is not None,
                                  config.max_request_body_bytes)
    add_tokenize_routes(app, serving, body_parser(config.max_request_body_bytes),
                        {**gated, **error_responses(400, 404, 413)})

    @app.get("/v1/models", response_model=ModelList, responses={**gated, **error_responses(503)})
    async def models() -> ModelList:
        root = getattr(getattr(engine.engine, "source", None), "path", None)
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=engine.max_model_len) for n in names])

    @app.get("/health", response_model=HealthStatus,
             responses={503: {"model": HealthStatus, "description": "Draining or dead: take this replica out"}})
    async def health() -> Response:
        """200 ``{"status": "ok"}`` while serving; 503 ``draining`` or ``dead`` (with ``error``)."""
        if engine.is_dead:
            return JSONResponse({"status": "dead", "error": str(engine.dead_error)}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    # A plain Response class: FastAPI would otherwise document the text reply as JSON too.
    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **gated})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/controller", responses={**gated, **error_responses(404, 503)})
    async def controller() -> dict:
        """The SLO controller's settings, targets, step-time model, observed p99s and frontier."""
        report = engine.snapshot().controller
        if report is None:
            raise APIError(404, "the SLO controller is off; start the server with --slo-ttft-ms and/or --slo-tpot-ms",
                           code="controller_off")
        return report.as_dict()

    @app.get("/stats", responses=gated)
    async def stats() -> dict:
        return engine_stats(engine.snapshot())

    @app.get("/version", responses=gated)
    async def version() -> dict:
        return {"version": deepbatch.__version__}

    install_dashboard(app)
    add_request_schemas(app, [CompletionRequest, ChatCompletionRequest, *TOKENIZE_MODELS])
    return app


def _call_soon(loop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed
        pass


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that other processes can bind too (each gets a share of
    the connections); uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains instead of closing the port at once, and whose
    second fails the in-flight requests with a proper ending instead of cutting them off."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float):
        super().__init__(config)
        self.app_state: ServerState = app.state.server_state
        self.engine: EngineClient = app.state.engine
        self.shutdown_timeout = shutdown_timeout
        self.app_state.server = self

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving, and the
        # default SIGTERM action would turn a clean drain into a death by signal.
        state = self.app_state
        loop = state.loop
        name = signal.Signals(sig).name
        if loop is None:  # not serving yet
            self.should_exit = True
        elif state.forcing:  # a third signal: stop waiting for replies to be written
            self.should_exit = self.force_exit = True
        elif state.draining:
            state.forcing = True
            logger.warning("received %s during the drain: ending in-flight requests now", name)
            _call_soon(loop, state.spawn, self._force())
        else:
            state.draining = True
            logger.info("received %s: draining (up to %.0f s)", name, self.shutdown_timeout)
            _call_soon(loop, state.spawn, self._drain())

    async def _drain(self) -> None:
        aborted = await self.engine.drain(self.shutdown_timeout)
        if aborted:
            logger.warning("shutdown timeout: aborted %d in-flight request(s)", aborted)
        self.should_exit = True

    async def _force(self) -> None:
        state = self.app_state
        if state.exit_code == EXIT_OK:
            state.exit_code = EXIT_FORCED
        loop = asyncio.get_running_loop()
        # Stopping joins the engine thread after the step in progress, so it runs off the loop;
        # the engine then fails every request it holds, and the routes turn that into an error
        # reply (an error event and [DONE] on a stream).
        try:
            await loop.run_in_executor(None, self.engine.shutdown)
        except Exception:  # the exit must not wait on a third signal
            logger.exception("stopping the engine failed")
        deadline = loop.time() + _FORCED_FLUSH_S
        while state.open_requests and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True
        # With every reply written, uvicorn's ordinary shutdown is quick and runs the lifespan's
        # end; its force exit would skip that and drop replies still being written, so it is kept
        # for clients that stop reading.
        if state.open_requests:
            logger.warning("%d reply(ies) still being written after %.0f s; closing their connections",
                           state.open_requests, _FORCED_FLUSH_S)
            self.force_exit = True


def run_server(engine: EngineClient, config: ServerConfig, tracer_provider=None) -> int:
    """Serve until drained or dead; returns the process exit code (``EXIT_*``). The caller is
    expected to exit with it: from then on SIGTERM and SIGINT are ignored."""
    app = build_app(engine, config, tracer_provider)
    state: ServerState = app.state.server_state
    uv_config = uvicorn.Config(
        ContainErrors(app), host=config.host, port=config.port, log_level="info", lifespan="on",
        # h11, whatever else is installed (Ray Serve brings httptools): httptools answers a header
        # byte it dislikes (DEL in X-Request-Id, a content type) with a plain-text 400 before the
        # app sees the request, where clients must get the OpenAI error body.
        http="h11",
        loop=config.event_loop,
        # Aborted requests answer within a step; this only bounds a stuck client write.
        timeout_graceful_shutdown=10,
        # An idle keep-alive connection stays open longer than clients and load balancers keep
        # theirs (httpx 5 s, common balancers 60 s): when the server closes first, a request the
        # client sends at that moment meets a closed socket and is lost before it is read.
        timeout_keep_alive=_KEEP_ALIVE_S,
    )
    server = _DrainingServer(uv_config, app, config.shutdown_timeout)
    if state.keys is not None and not len(state.keys):
        logger.warning("the API keys file %s holds no key: every request but /health gets 401", config.api_keys_file)

    def on_sighup(sig: int, frame) -> None:
        if state.loop is not None:  # before start-up the file just read is current
            _call_soon(state.loop, reload_keys, state, config)

    # Signal handlers can only be installed from the main thread.
    reloading = config.api_keys_file is not None and threading.current_thread() is threading.main_thread()
    if reloading:
        previous = signal.signal(signal.SIGHUP, on_sighup)
    if threading.current_thread() is threading.main_thread():
        # uvicorn puts back the handlers it found when it stops serving, while the process is
        # still closing down (the event loop's executor, the engine): were those the defaults, a
        # signal in that window would turn a clean exit into death by signal.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, server.handle_exit)
    try:
        server.run(sockets=[_reuse_port_socket(config.host, config.port)] if config.reuse_port else None)
    finally:
        if reloading:
            signal.signal(signal.SIGHUP, previous)
        # A forced exit skips the lifespan's shutdown. An engine thread still inside a torch op
        # while the interpreter finalizes aborts the process (SIGABRT, "terminate called without
        # an active exception"), so it is always stopped before returning; stopping is idempotent.
        engine.shutdown()
        if threading.current_thread() is threading.main_thread():
            # The process is on its way out. Interpreter finalization puts Python-level handlers
            # back to the default action (which a signal in that window turns into death by
            # signal) but leaves an ignored signal ignored.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
    return state.exit_code
