"""What the API server calls an engine: requests in, ``RequestStream``s out, on the event loop.

Two engines stand behind this surface:

- ``AsyncEngine`` (``async_engine.py``) steps ``LLMEngine`` on a thread of this process
  (offline use, Ray Serve replicas, ``DEEPBATCH_ENGINE_PROCESS=0``);
- ``EngineCoreClient`` (``core_client.py``) talks to the engine core in a process of its own,
  so the server's HTTP, tokenization and streaming never share an interpreter lock with the
  steps (``deepbatch serve``).

This class holds what both do on the event loop: request ids, the queue bounds, streams,
observers, the dead state, and the drain. Subclasses supply how a request reaches the engine
(``add_requests``), ``abort``, ``start``/``shutdown`` and the counters (``snapshot``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from deepbatch.core.errors import EngineDeadError
from deepbatch.core.outputs import RequestOutput
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.engine.admission import QueueBounds, RequestIds
from deepbatch.engine.request_stream import RequestStream
from deepbatch.engine.snapshot import EngineSnapshot

logger = logging.getLogger(__name__)

# Longest that ``drain`` waits for aborted requests to be answered once the timeout has passed; a
# step in progress must end before the engine sees the aborts.
_ABORT_GRACE_S = 30.0


class EngineDrainingError(RuntimeError):
    """The engine is draining for shutdown and accepts no new requests."""


@dataclass
class CheckedPrompt:
    """One checked prompt on its way to the engine."""

    request_id: str
    prompt: dict  # {"prompt_token_ids": [...], "prompt": text or None}
    params: SamplingParams
    priority: int
    tenant: str
    arrival_time: float
    stream: RequestStream
    num_seqs: int


# Called with every output of an iteration (metrics, tracing, the dashboard); must be quick.
Observer = Callable[[list[RequestOutput]], None]


class EngineClient:
    def __init__(self, engine, *, max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 tokenizer_threads: int = 2):
        # ``engine``: what validation and tokenization read (an LLMEngine, or a frontend with its
        # tokenizer and limits but no model).
        self.engine = engine
        self._bounds = QueueBounds(max_queued_requests, max_queued_tokens)
        self._pool = ThreadPoolExecutor(max(1, tokenizer_threads), thread_name_prefix="deepbatch-tokenize")
        self._draining = False
        self._stopping = False
        self._dead: EngineDeadError | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side: requests not yet answered
        self._ids = RequestIds()  # event-loop side
        self._observers: list[Observer] = []
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []

    # -- read-only views ------------------------------------------------------------------------

    model_name = property(lambda self: self.engine.model_name)
    max_model_len = property(lambda self: self.engine.max_model_len)
    tokenizer = property(lambda self: self.engine.tokenizer)
    max_queued_requests = property(lambda self: self._bounds.max_queued_requests)
    max_queued_tokens = property(lambda self: self._bounds.max_queued_tokens)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        raise NotImplementedError

    @property
    def cache_info(self) -> dict[str, str] | None:
        """The labels of ``vllm:cache_config_info`` (None without an ``EngineConfig``)."""
        raise NotImplementedError

    def add_observer(self, observer: Observer) -> None:
        self._observers.append(observer)

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """``callback(error)`` runs once the engine has died (on any thread)."""
        self._dead_callbacks.append(callback)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, let in-flight ones finish for up to ``timeout`` seconds, then abort
        the rest (they end with finish_reason "abort"). Returns how many were aborted."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while self._streams and not self.is_dead and loop.time() < deadline:
            await asyncio.sleep(0.05)
        remaining = list(self._streams)
        for request_id in remaining:
            self.abort(request_id)
        deadline = loop.time() + _ABORT_GRACE_S
        while self._streams and not self.is_dead and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return len(remaining)

    # -- requests -------------------------------------------------------------------------------

    async def apply_chat_template(self, messages: list[dict], /, **kwargs) -> list[int]:
        return await self._in_pool(self.engine.apply_chat_template, messages, **kwargs)

    async def _in_pool(self, fn, /, *args, **kwargs):
        # Positional-only: caller keyword arguments (chat template variables) may be named "fn".
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, *,
                          priority: int = 0, tenant: str = "default",
                          arrival_time: float | None = None) -> RequestStream:
        """Validate (raising InvalidRequestError, QueueFullError, EngineDrainingError or
        EngineDeadError) and enqueue one request; its updates arrive on the returned stream."""
        streams = await self.add_requests([(request_id, prompt)], params, priority=priority, tenant=tenant,
                                          arrival_time=arrival_time)
        return streams[0]

    async def add_requests(self, prompts: list[tuple[str, str | list[int] | dict]], params: SamplingParams, *,
                           priority: int = 0, tenant: str = "default",
                           arrival_time: float | None = None) -> list[RequestStream]:
        """``add_request`` for the ``(request_id, prompt)`` pairs of one API call, all or none:
        the queue bounds apply to them together, and if one is refused none is queued."""
        self._check_accepting()
        num_seqs = params.n * len(prompts)
        self._bounds.check_fits(num_seqs, 0, params.n)
        self._ids.reserve([request_id for request_id, _ in prompts], params.n)
        try:
            arrival = time.monotonic() if arrival_time is None else arrival_time
            if params.structured_outputs is not None:
                # Compiling a grammar can take seconds: in a worker thread of its own (not the
                # event loop, not the tokenizer pool), once for all prompts. A grammar that cannot
                # compile is refused here, before anything is queued.
                params = await asyncio.to_thread(self.engine.prepare_structured_output, params)
            # Validation and tokenization in the pool; token ids travel on, so the engine never
            # tokenizes (it re-validates cheaply).
            checked = [await self._in_pool(self._check_prompt, request_id, prompt, params, priority, tenant, arrival)
                       for request_id, prompt in prompts]
            num_tokens = sum(len(ids) for _, ids in checked) * params.n
            self._bounds.check_fits(num_seqs, num_tokens, params.n)
            loop = asyncio.get_running_loop()
            adds = [CheckedPrompt(request_id, {"prompt_token_ids": ids, "prompt": text}, params, priority, tenant,
                                  arrival, RequestStream(request_id, loop), params.n)
                    for (request_id, _), (text, ids) in zip(prompts, checked)]
            self._submit(adds, num_seqs, num_tokens)
        except BaseException:
            for request_id, _ in prompts:
                self._forget(request_id)
            raise
        for add in adds:
            self._streams[add.request_id] = add.stream
        return [add.stream for add in adds]

    def _check_prompt(self, request_id: str, prompt, params: SamplingParams, priority: int, tenant: str,
                      arrival: float) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids, or InvalidRequestError (in the tokenizer pool)."""
        raise NotImplementedError

    def _submit(self, adds: list[CheckedPrompt], num_seqs: int, num_tokens: int) -> None:
        """Hand the checked prompts to the engine, or raise (QueueFullError, ...) and queue none."""
        raise NotImplementedError

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its updates; leaving early (or being cancelled) aborts it."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stream = await self.add_request(request_id, prompt, params, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request and free its KV blocks; non-blocking, safe in ``finally`` during
        cancellation. The stream receives a final output with finish_reason "abort"."""
        raise NotImplementedError

    def _forget(self, request_id: str) -> None:
        """The request has been answered: its id and its samples' ids are free again."""
        self._streams.pop(request_id, None)
        self._ids.release(request_id)

    def _check_accepting(self, num_seqs: int = 0, num_tokens: int = 0) -> None:
        if self._dead is not None:
            raise self._dead
        if self._draining or self._stopping:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        self._bounds.check_room(self._queued(), (num_seqs, num_tokens))

    def _queued(self) -> tuple[int, int]:
        """Sequences and prompt tokens waiting in the engine or on their way there."""
        raise NotImplementedError

    def _run_dead_callbacks(self, error: EngineDeadError) -> None:
        for callback in self._dead_callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one callback must not stop the others
                logger.exception("dead-engine callback failed")

    def _notify_observers(self, outputs: list[RequestOutput]) -> None:
        for observer in self._observers:
            try:
                observer(outputs)
            except Exception:  # metrics must never take the engine down
                logger.exception("engine output observer failed")

    # -- on the event loop ------------------------------------------------------------------------

    def _deliver(self, items: list[tuple[RequestStream, RequestOutput]]) -> None:
        for stream, out in items:
            stream._put(out)
            if out.finished:
                self._forget(stream.request_id)

    def _deliver_error(self, items: list[tuple[RequestStream, BaseException]]) -> None:
        for stream, error in items:
            stream._fail(error)
            self._forget(stream.request_id)
