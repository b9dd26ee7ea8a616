"""``RoutedEngineClient``: the ``EngineClient`` surface ``OpenAIServing`` uses, in front of the engine
replicas, so the ingress answers exactly as the single-process server does.

    add_requests:  tokenize (the ingress holds the tokenizer, not the weights) -> pick the arm
                   -> send an EngineCall through the arm's handle -> wait for Accepted/Refusal
                   (all prompts of one call, or none) -> a RequestStream per prompt
    pump:          replica outputs -> the RequestStream, timing TTFT/TPOT/e2e per arm

A request that fails before anything of it was streamed (the replica died or refused it, or the
canary failed it before its first token) is sent again, to the stable arm, up to
``max_attempts`` tries in all; the client never sees the failure. After that, or once streaming has begun, it
ends with a clear 503. A rollback moves the canary's requests that have not started streaming
to the stable arm the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from deepbatch.api.errors import APIError
from deepbatch.engine.admission import RequestIds
from deepbatch.core.errors import InvalidRequestError
from deepbatch.engine.llm_engine import LLMEngine
from deepbatch.core.outputs import RequestOutput
from deepbatch.engine.request_stream import RequestStream
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.models.loader import load_hf_config, load_tokenizer, max_model_len_of, resolve_model
from deepbatch.serve_ray.prefix_index import block_hashes
from deepbatch.serve_ray.protocol import REFUSED, Accepted, EngineCall, Refusal
from deepbatch.serve_ray.rollout import CANARY, STABLE, RolloutController

logger = logging.getLogger("deepbatch.serve_ray")

_RETRY_BACKOFF_S = 0.05
_MAX_CAUSE_CHARS = 300


class Frontend:
    """The model as the ingress needs it: config and tokenizer, no weights."""

    # The engine's own tokenization and chat templating (they read only ``self.tokenizer``),
    # so prompts become the same token ids, with the same errors, as in one process.
    tokenize = LLMEngine.tokenize
    apply_chat_template = LLMEngine.apply_chat_template

    def __init__(self, args: argparse.Namespace, cache_dir: str | None):
        self.source = resolve_model(args.model)
        self.hf_config = load_hf_config(self.source, cache_dir)
        self.tokenizer = load_tokenizer(self.source, args.tokenizer, cache_dir)
        self.max_model_len = max_model_len_of(self.hf_config, args.max_model_len)
        self.model_name = self.source.name

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """The shapes ``OpenAIServing`` submits: text, token ids, or ``{"prompt_token_ids"}``."""
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt) if prompt else []
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return None, list(prompt)


class ArmObserver:
    """Where per-arm samples go (metrics and the rollout's SLO watch); see metrics.py."""

    def first_token(self, arm: str, ttft: float) -> None: ...
    def finished(self, arm: str, error: bool, e2e: float | None = None, tpot: float | None = None) -> None: ...
    def retried(self, arm: str) -> None: ...
    def moved(self) -> None: ...


@dataclass(eq=False)
class _Flight:
    """One prompt of an API call, across its attempts."""

    request_id: str
    text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    stream: RequestStream
    arm: str = STABLE
    attempt: int = 0
    gen: object = None  # the attempt's DeploymentResponseGenerator
    started: bool = False  # an output has reached the stream
    moving: bool = False  # cancelled by a rollback, to be sent to stable
    attempt_start: float = 0.0
    first_token_time: float | None = None
    task: asyncio.Task | None = None
    hashes: dict[int, list[int]] = field(default_factory=dict)  # block size -> block hashes


class _Retry(Exception):
    """The attempt failed before anything was streamed; ``cause`` says why."""

    def __init__(self, cause: BaseException | str):
        super().__init__(str(cause))
        self.cause = cause


def _describe(e: BaseException | str) -> str:
    if isinstance(e, str):
        return e[:_MAX_CAUSE_CHARS]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:_MAX_CAUSE_CHARS]


class RoutedEngineClient:
    def __init__(self, frontend: Frontend, handles: dict, block_sizes: dict[str, int | None],
                 rollout: RolloutController, observer: ArmObserver, max_attempts: int = 3):
        self.engine = frontend  # OpenAIServing reads engine.engine.hf_config
        self.handles = {arm: h for arm, h in handles.items() if h is not None}
        self.block_sizes = block_sizes  # None where the arm has no prefix caching
        self.rollout = rollout
        self.observer = observer
        self.max_attempts = max_attempts
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="deepbatch-tokenize")
        self._ids = RequestIds()
        self._flights: dict[str, _Flight] = {}
        rollout.add_rollback_listener(self._move_canary_to_stable)

    model_name = property(lambda self: self.engine.model_name)
    max_model_len = property(lambda self: self.engine.max_model_len)
    tokenizer = property(lambda self: self.engine.tokenizer)
    # The ingress has no engine of its own to die; a replica's death is handled per request.
    is_dead = False
    dead_error = None

    @property
    def num_in_flight(self) -> int:
        return len(self._flights)

    async def _in_pool(self, fn, /, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def apply_chat_template(self, messages: list[dict], /, **kwargs) -> list[int]:
        return await self._in_pool(self.engine.apply_chat_template, messages, **kwargs)

    # -- submission ---------------------------------------------------------------------------

    async def add_requests(self, prompts: list[tuple[str, object]], params: SamplingParams, *, priority: int = 0,
                           tenant: str = "default", arrival_time: float | None = None) -> list[RequestStream]:
        """Like ``EngineClient.add_requests``: every prompt accepted by a replica, or none queued
        and the first refusal raised."""
        self._ids.reserve([request_id for request_id, _ in prompts], params.n)
        loop = asyncio.get_running_loop()
        flights: list[_Flight] = []
        try:
            # Tenants are split by name; requests of no tenant by the call's id.
            arm = self.rollout.arm_for(tenant if tenant != "default" else prompts[0][0])
            arm = arm if arm in self.handles else STABLE
            for request_id, prompt in prompts:
                text, ids = await self._in_pool(self.engine.prompt_ids, prompt)
                if not ids:
                    raise InvalidRequestError("prompt", "the prompt is empty")
                flights.append(_Flight(request_id, text, ids, params, priority, tenant,
                                       RequestStream(request_id, loop), arm=arm))
            results = await asyncio.gather(*(self._submit(f, f.arm) for f in flights), return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                # A client's mistake outranks a replica's trouble.
                raise next((e for e in failures if isinstance(e, InvalidRequestError)), failures[0])
        except BaseException:
            for f in flights:  # those that were accepted must not run on unread
                if f.gen is not None:
                    f.gen.cancel()
            for request_id, _ in prompts:
                self._ids.release(request_id)
            raise
        for f in flights:
            self._flights[f.request_id] = f
            f.task = asyncio.ensure_future(self._pump(f))
            f.task.add_done_callback(lambda _, f=f: self._done(f))
        return [f.stream for f in flights]

    def _call(self, f: _Flight, arm: str) -> EngineCall:
        block_size = self.block_sizes.get(arm)
        hashes = []
        if block_size:
            hashes = f.hashes.get(block_size)
            if hashes is None:
                hashes = f.hashes[block_size] = block_hashes(f.prompt_ids, block_size)
        # A retry may reach a replica that still holds the failed attempt's id.
        engine_id = f.request_id if f.attempt == 1 else f"{f.request_id}-retry{f.attempt - 1}"
        return EngineCall(engine_id, {"prompt_token_ids": f.prompt_ids, "prompt": f.text}, f.params, f.priority,
                          f.tenant, hashes, f.tenant if f.tenant != "default" else None)

    async def _submit(self, f: _Flight, arm: str) -> None:
        """Send ``f`` until a replica accepts it; later tries go to the stable arm. Raises the
        engine's refusal (InvalidRequestError at once) or, with the tries spent, an APIError."""
        cause: BaseException | str = "no attempt was made"
        while f.attempt < self.max_attempts:
            f.attempt += 1
            f.arm = arm
            f.attempt_start = time.monotonic()
            try:
                await self._send(f, arm)
                return
            except InvalidRequestError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of the attempt is the replica's
                if f.moving:  # a rollback cancelled it: not a failure, and not a try
                    f.moving = False
                    f.attempt -= 1
                else:
                    cause = e.cause if isinstance(e, _Retry) else e
                    self._attempt_failed(f, cause, retrying=f.attempt < self.max_attempts)
            arm = STABLE
        if isinstance(cause, REFUSED):
            raise cause  # the engine's refusal: 429 queue_full or 503, as one process answers it
        raise APIError(503, f"no engine replica could take the request in {self.max_attempts} attempt(s); last "
                            f"error: {_describe(cause)}", code="replica_unavailable")

    async def _send(self, f: _Flight, arm: str) -> None:
        f.gen = self.handles[arm].options(stream=True).generate.remote(self._call(f, arm))
        try:
            first = await f.gen.__anext__()
        except StopAsyncIteration:
            raise _Retry("the replica answered nothing") from None
        if isinstance(first, Refusal):
            raise first.error()
        if not isinstance(first, Accepted):
            raise _Retry(f"the replica answered {type(first).__name__} before accepting the request")

    def _attempt_failed(self, f: _Flight, cause: BaseException | str, retrying: bool) -> None:
        self.observer.finished(f.arm, error=True)
        if retrying:
            self.observer.retried(f.arm)
        logger.warning("request %s failed on the %s arm (attempt %d, %s): %s", f.request_id, f.arm, f.attempt,
                       "retrying on stable" if retrying else "giving up", _describe(cause))

    # -- streaming ----------------------------------------------------------------------------

    async def _pump(self, f: _Flight) -> None:
        while True:
            try:
                await self._forward(f)
                return
            except Exception as e:  # noqa: BLE001 - the attempt failed
                cause = e.cause if isinstance(e, _Retry) else e
                if f.moving:
                    f.moving = False
                    f.attempt -= 1
                elif f.started or f.attempt >= self.max_attempts:
                    self._attempt_failed(f, cause, retrying=False)
                    f.stream._fail(APIError(503, f"the engine replica serving this request failed "
                                                 f"{'mid-stream' if f.started else 'before its first token'} "
                                                 f"({_describe(cause)}); retry the request", code="replica_failed"))
                    return
                else:
                    self._attempt_failed(f, cause, retrying=True)
                try:
                    await asyncio.sleep(_RETRY_BACKOFF_S)
                    await self._submit(f, STABLE)
                except Exception as e2:  # noqa: BLE001 - no replica took it
                    f.stream._fail(e2 if isinstance(e2, APIError) else APIError(
                        503, f"the request could not be resent: {_describe(e2)}", code="replica_unavailable"))
                    return

    def _done(self, f: _Flight) -> None:
        """The pump has ended, however (a cancelled task may never have started)."""
        if not f.stream.finished:  # aborted: the replica stops, nobody reads the stream any more
            if f.gen is not None:
                f.gen.cancel()
            f.stream._fail(APIError(503, "the request was aborted", code="aborted"))
        self._flights.pop(f.request_id, None)
        self._ids.release(f.request_id)

    async def _forward(self, f: _Flight) -> None:
        async for out in f.gen:
            if f.moving:  # an output that raced the rollback's cancel: the attempt is over
                raise _Retry("moved to the stable arm")
            if not isinstance(out, RequestOutput):
                continue
            out = dataclasses.replace(out, request_id=f.request_id, prompt=f.text, prompt_token_ids=f.prompt_ids)
            if out.error and not f.started and f.arm == CANARY:
                # The canary's flags may be at fault; on stable it is the request's own failure.
                raise _Retry(f"the request failed in the engine: {out.error}")
            now = time.monotonic()
            tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if f.first_token_time is None and tokens:
                f.first_token_time = now
                self.observer.first_token(f.arm, now - f.attempt_start)
            f.started = True
            f.stream._put(out)
            if out.finished:
                tpot = (now - f.first_token_time) / (tokens - 1) if tokens > 1 else None
                self.observer.finished(f.arm, error=bool(out.error), e2e=now - f.attempt_start, tpot=tpot)
                return
        raise _Retry("the replica's stream ended before the request finished")

    # -- control ------------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is not None and f.task is not None:
            f.task.cancel()

    def _move_canary_to_stable(self) -> None:
        """Rollback: the canary's requests that have streamed nothing go to stable now."""
        for f in list(self._flights.values()):
            if f.arm == CANARY and not f.started and f.gen is not None and not f.moving:
                f.moving = True
                self.observer.moved()
                f.gen.cancel()

    def shutdown(self) -> None:
        for f in list(self._flights.values()):
            if f.task is not None:
                f.task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
