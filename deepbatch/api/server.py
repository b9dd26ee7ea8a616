"""The OpenAI-compatible HTTP server: app factory, auth, request gate, routes, graceful drain.

    uvicorn (event loop)  --  FastAPI routes  --  OpenAIServing  --  AsyncEngine (engine thread)

Lifecycle:
- start: the model loads before the port opens, so a reachable /health means ready;
- SIGTERM / SIGINT: drain. /health and every /v1 route answer 503, in-flight requests run until
  ``shutdown_timeout``, the rest end with finish_reason "abort", then the process exits 0.
  A second signal exits at once;
- a failed model step: in-flight requests get an error, /health answers 503, and after a short
  grace (so health checkers see the 503) the process exits 1.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

import deepbatch
from deepbatch.api.errors import APIError, bad_request, error_response, from_validation_error, install_error_handlers
from deepbatch.api.metrics import ServerMetrics, engine_stats, log_stats_periodically
from deepbatch.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from deepbatch.api.serving import OpenAIServing
from deepbatch.engine.async_engine import AsyncEngine

logger = logging.getLogger("deepbatch.server")

# How long a dead server keeps answering 503 before it exits, so health checks can see it.
_DEAD_EXIT_GRACE_S = 2.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # empty: the engine's model name
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    max_request_body_bytes: int = 4 << 20
    log_stats_interval: float = 10.0


@dataclass
class ServerState:
    draining: bool = False
    exit_code: int = 0
    server: uvicorn.Server | None = None
    loop: asyncio.AbstractEventLoop | None = None
    tasks: set = field(default_factory=set)

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)  # a strong reference, so the task is not collected mid-flight
        task.add_done_callback(self.tasks.discard)


class _Gate:
    """Pure-ASGI checks before routing: API key on every route but /health, and 503 on /v1 while
    draining or dead. (Starlette's BaseHTTPMiddleware would hide client disconnects.)"""

    def __init__(self, app, engine: AsyncEngine, state: ServerState, api_key: str | None):
        self.app = app
        self.engine = engine
        self.state = state
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check(self, scope) -> APIError | None:
        path = scope["path"]
        if self.expected is not None and path != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
        if path.startswith("/v1/") and (self.state.draining or self.engine.is_dead):
            code = "engine_dead" if self.engine.is_dead else "server_draining"
            return APIError(503, "the server is shutting down; retry on another replica", code=code)
        return None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past ``limit`` bytes, 400 for anything but an object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_type")
    return body


def _openapi_body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    names = list(config.served_model_names) or [engine.model_name]
    state = ServerState()
    serving = OpenAIServing(engine, names)
    metrics = ServerMetrics(engine, names[0])

    def on_engine_dead(error) -> None:  # on the event loop
        state.exit_code = 1
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
    app.add_middleware(_Gate, engine=engine, state=state, api_key=config.api_key)

    async def parse(request: Request, model):
        body = await read_json_object(request, config.max_request_body_bytes)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None

    @app.post("/v1/completions", openapi_extra=_openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serving.completions(await parse(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await parse(request, ChatCompletionRequest), request)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        root = getattr(getattr(engine.engine, "source", None), "path", None)
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=engine.max_model_len) for n in names])

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return JSONResponse({"status": "dead"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/controller")
    async def controller() -> dict:
        """The SLO controller's settings, targets, step-time model, observed p99s and frontier."""
        report = engine.snapshot().controller
        if report is None:
            raise APIError(404, "the SLO controller is off; start the server with --slo-ttft-ms and/or --slo-tpot-ms",
                           code="controller_off")
        return report.as_dict()

    @app.get("/stats")
    async def stats() -> dict:
        return engine_stats(engine.snapshot())

    @app.get("/version")
    async def version() -> dict:
        return {"version": deepbatch.__version__}

    _add_request_schemas(app, [CompletionRequest, ChatCompletionRequest])
    return app


def _add_request_schemas(app: FastAPI, models: list) -> None:
    """Bodies are parsed by hand (to answer 400, never 422), so FastAPI does not see their models;
    put them into the OpenAPI document for clients and fuzzers."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(s.pop("$defs", {}))
                components[model.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _call_soon(loop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed
        pass


class _DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains instead of closing the port at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float):
        super().__init__(config)
        self.app_state: ServerState = app.state.server_state
        self.engine: AsyncEngine = app.state.engine
        self.shutdown_timeout = shutdown_timeout
        self.app_state.server = self

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving, and the
        # default SIGTERM action would turn a clean drain into a death by signal.
        loop = self.app_state.loop
        if self.app_state.draining or loop is None:
            self.should_exit = True
            if self.app_state.draining:
                self.force_exit = True
            return
        self.app_state.draining = True
        logger.info("received %s: draining (up to %.0f s)", signal.Signals(sig).name, self.shutdown_timeout)
        _call_soon(loop, self.app_state.spawn, self._drain())

    async def _drain(self) -> None:
        aborted = await self.engine.drain(self.shutdown_timeout)
        if aborted:
            logger.warning("shutdown timeout: aborted %d in-flight request(s)", aborted)
        self.should_exit = True


def run_server(engine: AsyncEngine, config: ServerConfig) -> int:
    """Serve until drained or dead; returns the process exit code."""
    app = build_app(engine, config)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level="info", lifespan="on",
        loop="auto",  # uvloop when it is installed, asyncio otherwise
        # Aborted requests answer within a step; this only bounds a stuck client write.
        timeout_graceful_shutdown=10, timeout_keep_alive=5,
    )
    server = _DrainingServer(uv_config, app, config.shutdown_timeout)
    server.run()
    return app.state.server_state.exit_code
