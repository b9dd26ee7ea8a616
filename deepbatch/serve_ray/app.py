"""The Serve application: ``serve run deepbatch.serve_ray.app:app [key=value ...]``, or
``import_path: deepbatch.serve_ray.app:app`` with ``args:`` in a Serve config file (see
deploy/ray/serve-config.yaml and docs/scale-out.md).

    OpenAIIngress  --handle (PrefixAwareRouter)-->  "stable": EngineReplica x N
                   --handle (PrefixAwareRouter)-->  "canary": EngineReplica x M   (optional)

Bad arguments fail here, when the application is built, not in every replica.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deepbatch.serve_ray.args import AUTOSCALING_DEFAULTS, AppArgs, ArmArgs, engine_namespace
from deepbatch.serve_ray.ingress import OpenAIIngress
from deepbatch.serve_ray.replica import EngineReplica
from deepbatch.serve_ray.rollout import CANARY, STABLE
from deepbatch.serve_ray.rollout_spec import load_spec

# Ray's default router, named the way RequestRouterConfig takes it.
_POWER_OF_TWO = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def _num_gpus(arm: ArmArgs, engine_args) -> float:
    """GPUs per replica: one per tensor-parallel rank, unless the engine runs on the CPU or the
    cluster (or, before Ray is up, this machine) has none."""
    if arm.num_gpus is not None:
        return arm.num_gpus
    if engine_args.device == "cpu":
        return 0.0
    if ray.is_initialized():
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    else:
        import torch

        has_gpus = torch.cuda.is_available()
    return float(engine_args.tensor_parallel_size) if has_gpus else 0.0


def _router_config(args: AppArgs) -> RequestRouterConfig:
    if args.router == "power_of_two":
        router, kwargs = _POWER_OF_TWO, {}
    else:
        router = "deepbatch.serve_ray.router:PrefixAwareRouter"
        kwargs = {"imbalance_margin": args.imbalance_margin, "session_affinity": args.session_affinity}
    return RequestRouterConfig(request_router_class=router, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=args.routing_stats_period_s)


def _engine_deployment(name: str, arm: ArmArgs, engine_args: dict[str, Any], app: AppArgs):
    ns = engine_namespace(engine_args, "engine_args" if name == STABLE else "canary.engine_args")
    options: dict[str, Any] = dict(
        name=name, max_ongoing_requests=arm.max_ongoing_requests,
        ray_actor_options={"num_cpus": arm.num_cpus, "num_gpus": _num_gpus(arm, ns)},
        request_router_config=_router_config(app),
        graceful_shutdown_timeout_s=app.graceful_shutdown_timeout_s,
    )
    if arm.autoscaling is not None:
        options["autoscaling_config"] = {**AUTOSCALING_DEFAULTS, **arm.autoscaling}
    else:
        options["num_replicas"] = arm.num_replicas
    return serve.deployment(EngineReplica).options(**options).bind(
        engine_args, name, arm.fault_inject_step_delay_s, arm.fault_inject_fail_every)


def build_app(args: dict[str, Any] | AppArgs) -> Application:
    config = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    # Read here, where the file is: the ingress may run on another node.
    config = config.model_copy(update={"rollout": load_spec(config.rollout).as_dict()})
    stable = _engine_deployment(STABLE, config, config.stable_engine_args(), config)
    canary = None
    if config.canary is not None:
        canary = _engine_deployment(CANARY, config.canary, config.canary_engine_args(), config)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", num_replicas=1, max_ongoing_requests=config.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(stable, canary, config)


# `serve run deepbatch.serve_ray.app:app model=... num_replicas=2` calls this with the arguments.
app = build_app
