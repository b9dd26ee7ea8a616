"""One engine per Serve replica, built from ``deepbatch serve``'s engine flags, streaming the
outputs of each ``EngineCall`` back to the ingress.

The replica is an API process of its own engine core, as ``deepbatch serve`` is
(``engine/core_client.py``): the core steps the model in a child process, so the replica's event
loop (Ray's calls, tokenization, detokenization, streaming) never shares an interpreter lock with
the steps. The core is spawned, not forked: a Ray worker runs threads of its own.

An engine that dies fails the replica's health check, so Serve replaces the replica; a request
in flight on it ends with the engine's error, which the ingress retries elsewhere if nothing
had been streamed yet.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import ray
from ray import serve

from deepbatch import envs
from deepbatch.api.metrics import engine_stats
from deepbatch.engine.core_client import EngineCoreClient
from deepbatch.engine_args import engine_config_from_args
from deepbatch.serve_ray.args import engine_namespace
from deepbatch.serve_ray.protocol import REFUSED, Accepted, EngineCall, Refusal

logger = logging.getLogger("deepbatch.serve_ray")


class InjectedFault(RuntimeError):
    """Testing only: raised by a replica started with ``fault_inject_fail_every``."""


class EngineReplica:
    def __init__(self, engine_args: dict, arm: str, fault_inject_step_delay_s: float = 0.0,
                 fault_inject_fail_every: int = 0):
        import torch

        args = engine_namespace(engine_args)
        torch.manual_seed(args.seed)
        self.engine = EngineCoreClient(
            engine_config_from_args(args), max_queued_requests=args.max_queued_requests or None,
            max_queued_tokens=args.max_queued_tokens or None, tokenizer_threads=envs.DEEPBATCH_TOKENIZER_THREADS,
            fault_inject_step=envs.DEEPBATCH_FAULT_INJECT_STEP, spawn=True, process_title=False)
        self.arm = arm
        self.set_faults(fault_inject_step_delay_s, fault_inject_fail_every)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.num_requests = 0
        # Serve runs the constructor on the replica's event loop, where the client reads the core.
        self.engine.start()
        logger.info("engine replica %s (%s arm) ready: %s", self.replica_id, arm, self.engine.model_name)

    async def generate(self, call: EngineCall) -> AsyncIterator:
        """``Accepted`` or a ``Refusal`` first, then the request's outputs. Prompts are not sent
        back: the ingress has them, and a long one would travel with every token."""
        self.num_calls += 1
        if self.fault_inject_fail_every and self.num_calls % self.fault_inject_fail_every == 0:
            raise InjectedFault(f"injected fault: replica {self.replica_id} fails every "
                                f"{self.fault_inject_fail_every} request(s)")
        try:
            stream = await self.engine.add_request(call.request_id, call.prompt, call.params,
                                                   priority=call.priority, tenant=call.tenant)
        except REFUSED as e:
            yield Refusal.of(e)
            return
        self.num_requests += 1
        yield Accepted(self.replica_id)
        try:
            async for out in stream:
                # Prompt logprobs only with the final output: each output carries the whole list.
                yield dataclasses.replace(out, prompt=None, prompt_token_ids=[],
                                          prompt_logprobs=out.prompt_logprobs if out.finished else None)
        finally:  # cancelled by the ingress (client gone, or moved to another arm)
            if not stream.finished:
                self.engine.abort(call.request_id)

    def set_faults(self, step_delay_s: float = 0.0, fail_every: int = 0) -> None:
        """Testing only: from now on every model step sleeps ``step_delay_s`` first, and every
        ``fail_every``-th request fails before it is queued (0: none). Broadcast to a deployment
        (``handle.broadcast("set_faults", ...)``) to break a live canary on purpose."""
        if step_delay_s < 0 or fail_every < 0:
            raise ValueError("set_faults: step_delay_s and fail_every must be >= 0")
        self.fault_inject_step_delay_s = step_delay_s
        self.fault_inject_fail_every = fail_every
        self.num_calls = 0
        self.engine.set_step_delay(step_delay_s)  # the core sleeps before each step

    def stats(self) -> dict:
        """The engine's ``/stats`` plus who this replica is and what it has served."""
        return {"replica": self.replica_id, "actor_name": self.actor_name, "arm": self.arm,
                "num_requests": self.num_requests, "num_in_flight": self.engine.num_in_flight,
                "kv_blocks": self.engine.engine.num_blocks, **engine_stats(self.engine.snapshot())}

    def record_routing_stats(self) -> dict:
        snap = self.engine.snapshot()
        return {"kv_blocks": self.engine.engine.num_blocks, "num_running": snap.num_running,
                "num_waiting": snap.num_waiting}

    def check_health(self) -> None:
        if self.engine.is_dead:
            raise RuntimeError(f"the engine is dead: {self.engine.dead_error}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
