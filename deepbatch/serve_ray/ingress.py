"""The OpenAI ingress deployment: the single-process server's routes and replies
(``OpenAIServing`` on a ``RoutedEngineClient``), plus the rollout's and the replicas' views.

    POST /v1/completions, /v1/chat/completions   as `deepbatch serve` answers them
    GET  /v1/models, /health, /metrics, /version
    GET  /v1/rollout            state, percent, per-arm window values, decisions
    POST /v1/rollout            body: a rollout spec; starts it over from its first step
    POST /v1/rollout/rollback   send the canary's share to 0 now
    GET  /v1/replicas           every engine replica's /stats, per arm

The rollout state lives in the ingress replica; run one (the default) so that one watch sees all
of the canary's traffic.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

import deepbatch
from deepbatch import envs
from deepbatch.api.auth import load_keys
from deepbatch.api.errors import APIError, install_error_handlers
from deepbatch.api.openapi import add_request_schemas, error_responses
from deepbatch.api.protocol import (
    ChatCompletionRequest, CompletionRequest, ErrorResponse, ModelCard,
    ModelList,
)
from deepbatch.api.gate import Gate
from deepbatch.api.request_body import read_json_object
from deepbatch.api.server import add_generation_routes
from deepbatch.api.server_config import ServerState
from deepbatch.api.serving import OpenAIServing
from deepbatch.serve_ray.args import AppArgs, engine_namespace
from deepbatch.serve_ray.client import Frontend, RoutedEngineClient
from deepbatch.serve_ray.metrics import ArmMetrics
from deepbatch.serve_ray.rollout import CANARY, STABLE, RolloutController
from deepbatch.serve_ray.rollout_spec import load_spec, parse_spec

logger = logging.getLogger("deepbatch.serve_ray")

_STATS_TIMEOUT_S = 10.0
_CONFLICT = {409: {"model": ErrorResponse, "description": "No canary is deployed, or no rollout to roll back"}}


def _block_size(ns) -> int | None:
    return ns.block_size if ns.enable_prefix_caching else None


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, stable, canary, args: AppArgs):
        stable_args = engine_namespace(args.stable_engine_args())
        block_sizes = {STABLE: _block_size(stable_args)}
        if canary is not None:
            block_sizes[CANARY] = _block_size(engine_namespace(args.canary_engine_args(), "canary.engine_args"))
        loop = asyncio.get_running_loop()
        frontend = await loop.run_in_executor(None, Frontend, stable_args, envs.DEEPBATCH_CACHE_DIR)
        self.args = args
        self.handles = {STABLE: stable, CANARY: canary}
        self.rollout = RolloutController(load_spec(args.rollout), has_canary=canary is not None)
        self.metrics = ArmMetrics(self.rollout)
        self.client = RoutedEngineClient(frontend, self.handles, block_sizes, self.rollout, self.metrics,
                                         args.max_attempts)
        self.names = args.served_model_names() or [frontend.model_name]
        self.serving = OpenAIServing(self.client, self.names)
        self.state = ServerState(keys=load_keys(args.api_keys_file, args.api_key))
        self._watch = asyncio.ensure_future(self.rollout.watch())
        logger.info("ingress ready: model %s, arms %s, rollout %s at %g%%", frontend.model_name,
                    [a for a, h in self.handles.items() if h is not None], self.rollout.state,
                    self.rollout.canary_percent)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    async def replica_stats(self) -> dict:
        """Every replica's stats, by arm (replicas that do not answer in time are left out)."""
        out = {}
        for arm, handle in self.handles.items():
            if handle is None:
                continue
            try:
                out[arm] = await handle.broadcast("stats").results_async(timeout_s=_STATS_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a report, not a request: say what failed
                out[arm] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return out

    def __del__(self):
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()


def build_ingress_app(ingress: OpenAIIngress) -> FastAPI:
    serving, client, rollout, args = ingress.serving, ingress.client, ingress.rollout, ingress.args
    app = FastAPI(title="deepbatch (Ray Serve)", version=deepbatch.__version__)
    install_error_handlers(app)
    app.add_middleware(Gate, engine=client, state=ingress.state)
    gated = add_generation_routes(app, serving, ingress.state.keys is not None, args.api_keys_file is not None,
                                  args.max_request_body_bytes)

    @app.get("/v1/models", response_model=ModelList, responses=gated)
    async def models() -> ModelList:
        frontend = client.engine
        return ModelList(data=[ModelCard(id=n, root=frontend.source.path, max_model_len=frontend.max_model_len)
                               for n in ingress.names])

    @app.get("/health")
    async def health() -> Response:
        """200 while the ingress serves; a replica's health is Serve's to watch and restore."""
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **gated})
    async def prometheus_metrics() -> Response:
        return Response(ingress.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", responses=gated)
    async def version() -> dict:
        return {"version": deepbatch.__version__}

    @app.get("/v1/rollout", responses=gated)
    async def rollout_state() -> dict:
        return rollout.report()

    @app.post("/v1/rollout", responses={**gated, **error_responses(400), **_CONFLICT})
    async def rollout_restart(request: Request) -> dict:
        """Start a rollout over with the spec in the body (the same fields as the app's ``rollout``)."""
        if not rollout.has_canary:
            raise APIError(409, "no canary deployment: start the application with a canary to roll it out",
                           code="no_canary")
        try:
            spec = parse_spec(await read_json_object(request, args.max_request_body_bytes))
        except ValueError as e:
            raise APIError(400, str(e), param="rollout", code="invalid_rollout_spec") from None
        rollout.restart(spec)
        return rollout.report()

    @app.post("/v1/rollout/rollback", responses={**gated, **_CONFLICT})
    async def rollout_rollback() -> dict:
        if rollout.state not in ("progressing", "promoted"):
            raise APIError(409, f"nothing to roll back: the rollout is {rollout.state}", code="not_rolling_out")
        rollout.rollback("by hand (POST /v1/rollout/rollback)")
        return rollout.report()

    @app.get("/v1/replicas", responses=gated)
    async def replicas() -> dict:
        return await ingress.replica_stats()

    add_request_schemas(app, [CompletionRequest, ChatCompletionRequest])
    return app
