"""The application's arguments (``serve run deepbatch.serve_ray.app:app key=value``, or ``args:``
in a Serve config file) and the engine arguments of each arm.

Engine arguments are ``deepbatch serve``'s own flags, named by their dests (``max_num_seqs``)
or as flags (``max-num-seqs``, ``--max-num-seqs``), and go through that command's parser, so
they mean, default and fail exactly as they do there. Mappings may also be given as a JSON
string, which is what a ``key=value`` argument of ``serve run`` can carry.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepbatch.engine_args import add_engine_args, add_queue_args

@functools.cache
def _parsers():
    """A parser of the engine's arguments and the queue bounds (``deepbatch serve``'s engine
    flags, from the one place they are declared), and their defaults."""
    parser = argparse.ArgumentParser(prog="engine_args", add_help=False)
    add_engine_args(parser, positional_model=False)
    add_queue_args(parser)
    return parser, vars(parser.parse_args([]))


def engine_arg_defaults() -> dict[str, Any]:
    return dict(_parsers()[1])


def normalize_engine_args(raw: dict[str, Any], where: str = "engine_args") -> dict[str, Any]:
    """Keys as dests; an unknown key is a ValueError naming it."""
    defaults = _parsers()[1]
    out = {}
    for key, value in raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in defaults:
            raise ValueError(f"{where}: unknown engine argument {key!r} (see `deepbatch serve --help`; "
                             "server options such as host or api_key are arguments of the application)")
        out[dest] = value
    return out


def engine_namespace(engine_args: dict[str, Any], where: str = "engine_args") -> argparse.Namespace:
    """``deepbatch serve``'s parsed arguments with these engine arguments, checked by its parser."""
    parser, defaults = _parsers()
    args = normalize_engine_args(engine_args, where)
    argv, unset = [], {}
    for dest, value in args.items():
        flag = "--" + dest.replace("_", "-")
        if value == defaults[dest] and type(value) is type(defaults[dest]):
            continue
        if value is None:  # no flag says "unset": set after parsing
            unset[dest] = None
        elif isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):  # a JSON flag (speculative_config)
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            ns = parser.parse_args(argv)
    except SystemExit:
        message = stderr.getvalue().strip().splitlines()
        raise ValueError(f"{where}: {message[-1] if message else 'invalid engine arguments'}") from None
    for dest, value in unset.items():
        setattr(ns, dest, value)
    return ns


def _json_mapping(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    return value


class ArmArgs(BaseModel):
    """One deployment of engine replicas."""

    model_config = ConfigDict(extra="forbid")

    # Fixed replicas, or Ray's autoscaling when ``autoscaling`` is set (it then wins).
    num_replicas: int = Field(1, ge=1)
    # Ray Serve's autoscaling_config; keys not given take AUTOSCALING_DEFAULTS.
    autoscaling: dict[str, Any] | None = None
    # Requests Serve lets into one replica at once; the engine queues beyond its max_num_seqs.
    max_ongoing_requests: int = Field(128, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    # None: tensor_parallel_size GPUs where the cluster has GPUs, else none.
    num_gpus: float | None = Field(None, ge=0)
    # Testing only: every model step sleeps this long first, and every n-th request fails
    # before it is queued (0: never), to exercise rollbacks and retries.
    fault_inject_step_delay_s: float = Field(0.0, ge=0)
    fault_inject_fail_every: int = Field(0, ge=0)

    autoscaling_from_json = field_validator("autoscaling", mode="before")(_json_mapping)


class CanaryArgs(ArmArgs):
    # Overrides of the stable arm's engine arguments: the flags under release.
    engine_args: dict[str, Any] = Field(default_factory=dict)

    engine_args_from_json = field_validator("engine_args", mode="before")(_json_mapping)


# Sane defaults for an engine that batches continuously: a replica is busy well before Serve's
# max_ongoing_requests; adding one when the average passes this keeps queues short.
AUTOSCALING_DEFAULTS = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}


class AppArgs(ArmArgs):
    """The stable arm's settings at the top level, the canary's under ``canary``."""

    model: str | None = None  # shortcut for engine_args.model (None: the embedded SmolLM2)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    canary: CanaryArgs | None = None
    # The rollout spec (a mapping, or a YAML/JSON file path); only used with a canary.
    rollout: dict[str, Any] | str | None = None
    router: Literal["prefix", "power_of_two"] = "prefix"
    imbalance_margin: int = Field(8, ge=0)
    session_affinity: bool = True
    # How often replicas report their KV blocks and prefix-cache counters to the routers.
    routing_stats_period_s: float = Field(5.0, gt=0)
    # Tries per request (the first included) while it has not started streaming.
    max_attempts: int = Field(3, ge=1)
    served_model_name: list[str] | str | None = None
    api_key: str | None = None
    api_keys_file: str | None = None
    max_request_body_bytes: int = Field(4 << 20, ge=1)
    # Seconds a replica being stopped lets its requests finish (deepbatch serve's --shutdown-timeout).
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    ingress_max_ongoing_requests: int = Field(4096, ge=1)

    engine_args_from_json = field_validator("engine_args", "canary", mode="before")(_json_mapping)

    def stable_engine_args(self) -> dict[str, Any]:
        args = normalize_engine_args(self.engine_args)
        if self.model is not None:
            args["model"] = self.model
        return args

    def canary_engine_args(self) -> dict[str, Any]:
        assert self.canary is not None
        return {**self.stable_engine_args(), **normalize_engine_args(self.canary.engine_args, "canary.engine_args")}

    def served_model_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [])
