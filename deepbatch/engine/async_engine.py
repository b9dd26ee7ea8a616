"""The asyncio front of ``LLMEngine`` in one process: an engine thread steps the model beside the
event loop (Ray Serve replicas, ``DEEPBATCH_ENGINE_PROCESS=0``; ``deepbatch serve`` runs the
engine core in a process of its own instead, ``core_client.py``).

    event loop (HTTP)                       engine thread (the only caller of LLMEngine)
    -----------------                       --------------------------------------------
    add_request: validate + tokenize        loop:  wait on the condition while idle
      (thread pool) -> inbox ---------->           apply inbox (add / abort)
    abort(id)            -> inbox ---------->      step() -> outputs
    RequestStream  <- call_soon_threadsafe <-      observers(outputs); publish snapshot

``LLMEngine`` is not thread-safe, so every call that touches scheduler state happens on the engine
thread, between steps. The event loop never waits on a step: it only appends to the inbox under
a lock that is held for a few instructions. ``make_requests`` (validation, tokenization) reads
only immutable engine state and runs in a thread pool, so a bad request fails synchronously,
before anything is queued; a structured-output grammar is compiled before that, in a worker
thread (``prepare_structured_output``), and a grammar that cannot compile fails the same way.

The waiting queue is bounded (``max_queued_requests`` sequences, ``max_queued_tokens`` prompt
tokens). A request larger than a bound can never be accepted and is an InvalidRequestError; one
that does not fit now gets QueueFullError with ``retry_after``: the time the queue's measured
drain rate needs to make room for it. The bounds, the drain rate and the request ids in flight
are kept in ``admission``; this module owns the counts they are checked against.

A step that raises kills the engine: every in-flight request gets ``EngineDeadError``, new
requests are refused with it, and the dead callbacks run (the server exits non-zero). A
tensor-parallel rank that fails while the engine is idle wakes the engine thread, whose
``check_health`` then raises the same way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace

from deepbatch.core.errors import EngineDeadError, InvalidRequestError
from deepbatch.core.outputs import RequestOutput
from deepbatch.engine.admission import QueueFullError
from deepbatch.engine.engine_client import CheckedPrompt, EngineClient, EngineDrainingError, Observer
from deepbatch.engine.request_stream import RequestStream
from deepbatch.engine.snapshot import EngineSnapshot, cache_config_info, take_snapshot, waiting_tokens

__all__ = ["AsyncEngine", "EngineDrainingError", "Observer", "QueueFullError"]

logger = logging.getLogger(__name__)


@dataclass
class _Abort:
    request_id: str


class AsyncEngine(EngineClient):
    """Observers and dead callbacks run on the engine thread."""

    def __init__(self, engine, *, max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 tokenizer_threads: int = 2, fault_inject_step: int | None = None):
        super().__init__(engine, max_queued_requests=max_queued_requests, max_queued_tokens=max_queued_tokens,
                         tokenizer_threads=tokenizer_threads)
        self._fault_inject_step = fault_inject_step
        self._cond = threading.Condition()
        # Guarded by _cond: the inbox, the sequences it holds, the engine's published waiting count
        # and the accepting state.
        self._inbox: list[CheckedPrompt | _Abort] = []
        self._pending_seqs = 0
        self._pending_tokens = 0
        self._num_waiting = 0
        self._num_waiting_tokens = 0
        self._faulted = False  # a rank failed between steps; the engine thread will find out
        self._active: dict[str, RequestStream] = {}  # engine-thread side: requests in the engine
        self._snapshot = EngineSnapshot()
        self._num_step_calls = 0
        self._thread: threading.Thread | None = None
        add_fault_listener = getattr(engine, "add_fault_listener", None)
        if add_fault_listener is not None:
            add_fault_listener(self._on_fault)

    @classmethod
    def from_config(cls, config, **kwargs) -> AsyncEngine:
        from deepbatch.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    # -- read-only views ------------------------------------------------------------------------

    @property
    def cache_info(self) -> dict[str, str] | None:
        return cache_config_info(self.engine)

    def snapshot(self) -> EngineSnapshot:
        """The newest counters; requests still in the inbox count as waiting."""
        snap = self._snapshot
        with self._cond:
            pending = self._pending_seqs
        if pending:
            snap = replace(snap, num_waiting=snap.num_waiting + pending)
        return snap

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._publish_snapshot()
            self._thread = threading.Thread(target=self._run, name="deepbatch-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (after the step in progress) and the tokenizer pool."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is None or not self._thread.is_alive():  # no step in flight any more
            engine_shutdown = getattr(self.engine, "shutdown", None)
            if engine_shutdown is not None:
                engine_shutdown()

    # -- requests -------------------------------------------------------------------------------

    def _check_prompt(self, request_id, prompt, params, priority, tenant, arrival) -> tuple[str | None, list[int]]:
        first = self.engine.make_requests(request_id, prompt, params, priority, tenant, arrival)[0]
        return first.prompt, first.prompt_token_ids

    def _submit(self, adds: list[CheckedPrompt], num_seqs: int, num_tokens: int) -> None:
        with self._cond:
            self._check_accepting(num_seqs, num_tokens)
            self._inbox.extend(adds)
            self._pending_seqs += num_seqs
            self._pending_tokens += num_tokens
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """End a request and free its KV blocks; non-blocking, safe in ``finally`` during
        cancellation. The stream receives a final output with finish_reason "abort"."""
        with self._cond:
            if self._dead is None and not self._stopping:
                self._inbox.append(_Abort(request_id))
                self._cond.notify()

    def _queued(self) -> tuple[int, int]:
        return self._pending_seqs + self._num_waiting, self._pending_tokens + self._num_waiting_tokens

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        has_work = False
        busy_since: float | None = None  # the end of the last iteration, while work carries over
        try:
            while True:
                with self._cond:
                    while not self._inbox and not has_work and not self._stopping and not self._faulted:
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._inbox = self._inbox, []
                start = time.monotonic() if busy_since is None else busy_since
                backlog = self._num_waiting > 0  # as of the last step, before this inbox
                if self._faulted:
                    self._faulted = False
                    engine.check_health()  # raises: the engine dies below
                outputs = self._apply(commands)
                waiting_before = (self._num_waiting, self._num_waiting_tokens)
                idle = False
                if engine.has_unfinished_requests():
                    self._num_step_calls += 1
                    if self._num_step_calls == self._fault_inject_step:
                        raise RuntimeError(f"injected fault at engine step {self._num_step_calls}")
                    steps_before = engine.stats.num_steps
                    outputs.extend(engine.step())
                    idle = engine.stats.num_steps == steps_before and not outputs
                has_work = engine.has_unfinished_requests()
                self._dispatch(outputs)
                self._publish_snapshot(refresh=not has_work)
                end = time.monotonic()
                waiting_after = (self._num_waiting, self._num_waiting_tokens)
                self._bounds.observe(start, end, backlog, waiting_before, waiting_after)
                busy_since = end if has_work else None
                if idle and has_work:
                    # Nothing could be scheduled (waiting on KV blocks that no step will free):
                    # wake on the next command instead of spinning.
                    with self._cond:
                        self._cond.wait(0.01)
        except BaseException as e:  # noqa: BLE001 - any fault in a step kills the engine
            self._die(e)
            return
        with self._cond:
            commands, self._inbox = self._inbox, []
        self._fail_all(EngineDeadError("the engine was shut down"),
                       [c.stream for c in commands if isinstance(c, CheckedPrompt)])

    def _apply(self, commands: list[CheckedPrompt | _Abort]) -> list[RequestOutput]:
        engine = self.engine
        outputs: list[RequestOutput] = []
        added = added_tokens = 0
        for cmd in commands:
            if isinstance(cmd, _Abort):
                out = engine.abort_request(cmd.request_id)
                if out is not None:
                    outputs.append(out)
                continue
            added += cmd.num_seqs
            added_tokens += len(cmd.prompt["prompt_token_ids"]) * cmd.num_seqs
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority, cmd.tenant, cmd.arrival_time)
            except InvalidRequestError as e:  # validated already; answer this request, keep serving
                self._post(self._deliver_error, [(cmd.stream, e)])
                continue
            except Exception as e:  # noqa: BLE001 - one request that cannot be queued ends alone
                logger.exception("request %s could not be queued", cmd.request_id)
                engine.abort_request(cmd.request_id)  # whatever part of it was queued
                self._post(self._deliver_error, [(cmd.stream, e)])
                continue
            self._active[cmd.request_id] = cmd.stream
        with self._cond:
            self._pending_seqs -= added
            self._pending_tokens -= added_tokens
            self._num_waiting = engine.scheduler.num_waiting
            self._num_waiting_tokens = waiting_tokens(engine)
        return outputs

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        self._notify_observers(outputs)
        pairs = []
        for out in outputs:
            stream = self._active.pop(out.request_id, None) if out.finished else self._active.get(out.request_id)
            if stream is not None:
                pairs.append((stream, out))
        self._post(self._deliver, pairs)

    def _on_fault(self) -> None:
        with self._cond:
            self._faulted = True
            self._cond.notify()

    def _publish_snapshot(self, refresh: bool = False) -> None:
        e = self.engine
        self._snapshot = take_snapshot(e, self._snapshot, refresh)
        with self._cond:
            self._num_waiting = e.scheduler.num_waiting
            self._num_waiting_tokens = waiting_tokens(e)

    def _die(self, exc: BaseException) -> None:
        logger.error("engine step failed; the engine is dead", exc_info=exc)
        message = f"the engine stopped after an error in a model step: {type(exc).__name__}: {exc}"[:1000]
        error = EngineDeadError(message)
        with self._cond:
            self._dead = error
            commands, self._inbox = self._inbox, []
            self._pending_seqs = 0
            self._pending_tokens = 0
        # Callbacks first: by the time a client reads its error, the server already reports dead.
        self._run_dead_callbacks(error)
        self._fail_all(error, [c.stream for c in commands if isinstance(c, CheckedPrompt)])

    def _fail_all(self, error: BaseException, extra: list[RequestStream]) -> None:
        streams = list(self._active.values()) + extra
        self._active.clear()
        self._post(self._deliver_error, [(stream, error) for stream in streams])

    @staticmethod
    def _post(fn, pairs: list[tuple[RequestStream, object]]) -> None:
        """Run ``fn(pairs)`` on the streams' event loop(s), one callback per loop per iteration."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in pairs:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(fn, items)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass
