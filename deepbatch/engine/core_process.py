"""The engine core in a process of its own: a busy loop that steps the model and never waits on
HTTP, JSON or SSE framing, which stay in the API process (``core_client.py``).

    input thread                              busy loop (main thread, the only caller of LLMEngine)
    ------------                              -----------------------------------------------------
    PULL socket -> decode -> make_requests    loop: take the inbox (adds, aborts)
      (re-validation, grammar compile)              step() -> outputs
      -> inbox                                      one StepOutputs message: what is new per request
    parent gone? -> Shutdown into the inbox         (idle: block on the inbox)

The input thread does the per-request work that needs no scheduler state (decoding, the
request's checks, compiling its grammar), so the loop only appends ready ``Request`` objects to
the scheduler between steps. One message leaves per engine iteration, whatever the number of
requests and tokens in it.

The core exits when the API process asks (``Shutdown``), when the API process is gone (its pid
is no longer our parent: a killed server leaves no engine holding the GPU), and when a step
fails (after sending ``Dead``). SIGINT and SIGTERM are ignored: the API process drains first and
then asks the core to stop, so a signal sent to the whole process group does not cut the drain.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from deepbatch.config import EngineConfig
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.request import Request
from deepbatch.engine.core_messages import (
    SNAPSHOT_INTERVAL_S, Abort, AddRequest, CompletionDelta, Dead, OutputDelta, Ready, Shutdown, StepOutputs,
    decode_client_message, encode,
)
from deepbatch.engine.output_processor import parent_state
from deepbatch.engine.snapshot import EngineSnapshot, cache_config_info, take_snapshot, waiting_tokens

logger = logging.getLogger("deepbatch.engine_core")

# How often the input thread checks that the API process is still there.
_PARENT_POLL_MS = 200


@dataclass(frozen=True)
class CoreAddresses:
    """ZMQ endpoints: the core PULLs ``inputs`` and PUSHes ``outputs``; the API process binds both."""

    inputs: str
    outputs: str


@dataclass
class _Added:
    requests: list[Request]


@dataclass
class _Refused:
    request_id: str
    error: BaseException
    num_seqs: int  # what the API process counted as on its way to the queue
    num_tokens: int


class _Stop(Exception):
    pass


def run_engine_core(config: EngineConfig, addresses: CoreAddresses, fault_inject_step: int | None = None,
                    parent_pid: int | None = None) -> None:
    """Process entry point: build the engine, say ``Ready``, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_process_title("deepbatch::EngineCore")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    parent_pid = parent_pid or os.getppid()
    ctx = zmq.Context()
    # Its own context, so that an exit can flush what is queued on it (the last message says
    # why) while the input thread still holds the other socket.
    out_ctx = zmq.Context()
    outputs = out_ctx.socket(zmq.PUSH)
    # No high-water mark: a busy API process must never stall the engine's loop on a send.
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(addresses.outputs)
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.setsockopt(zmq.LINGER, 0)
    inputs.connect(addresses.inputs)
    engine = None
    try:
        import torch

        from deepbatch.engine.llm_engine import LLMEngine

        torch.manual_seed(config.model.seed)
        engine = LLMEngine(config)
        core = EngineCore(engine, outputs, fault_inject_step)
        # The model, the tokenizer and the modules stay for the process's life: out of the
        # collector's generations, the objects each step creates are collected without them.
        gc.collect()
        gc.freeze()
        outputs.send(encode(core.ready()))
        threading.Thread(target=core.read_inputs, args=(inputs, parent_pid), name="deepbatch-core-input",
                         daemon=True).start()
        core.run()
    except BaseException as e:  # noqa: BLE001 - the API process must hear why; then exit non-zero
        logger.error("the engine core failed", exc_info=e)
        message = f"the engine stopped after an error in a model step: {type(e).__name__}: {e}"[:1000]
        _send_quietly(outputs, Dead(message))
        _stop_engine(engine)
        outputs.close(linger=2000)
        out_ctx.term()  # waits until Dead is delivered (or 2 s)
        os._exit(1)  # the input thread may sit in a socket call; nothing else needs to run
    _stop_engine(engine)
    _send_quietly(outputs, Dead("the engine was shut down", stopped=True))
    outputs.close(linger=2000)
    out_ctx.term()
    inputs.close()
    ctx.term()


def _stop_engine(engine) -> None:
    """Stop the tensor-parallel workers, if any."""
    if engine is None:
        return
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        logger.exception("stopping the engine failed")


def _send_quietly(socket, message) -> None:
    try:
        socket.send(encode(message), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass


def set_process_title(title: str) -> None:
    """The name ``ps`` shows (``deepbatch::EngineCore``, ``deepbatch::APIServer``)."""
    try:
        import setproctitle
    except ImportError:  # a nicety for ``ps``; never a reason to fail
        return
    setproctitle.setproctitle(title)


class EngineCore:
    def __init__(self, engine, outputs, fault_inject_step: int | None = None):
        self.engine = engine
        self.outputs = outputs
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._fault_inject_step = fault_inject_step
        self._num_step_calls = 0
        self._sent: dict[str, _SentSoFar] = {}  # parent id -> how much of its output was sent
        self._applied_seqs = 0
        self._applied_tokens = 0
        self._snapshot = EngineSnapshot()
        self._snapshot_time = 0.0
        engine.add_fault_listener(self.on_fault)

    def ready(self) -> Ready:
        self._snapshot = take_snapshot(self.engine, self._snapshot, refresh=True)
        return Ready(os.getpid(), self.engine.num_blocks, cache_config_info(self.engine), pickle.dumps(self._snapshot))

    # -- the input thread -------------------------------------------------------------------------

    def read_inputs(self, socket, parent_pid: int) -> None:
        engine = self.engine
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while True:
            if not poller.poll(_PARENT_POLL_MS):
                if os.getppid() != parent_pid:
                    logger.error("the API process (pid %d) is gone; stopping the engine core", parent_pid)
                    self.inbox.put(Shutdown())
                    return
                continue
            try:
                message = decode_client_message(socket.recv())
            except Exception:  # noqa: BLE001 - a message we cannot read is dropped, never fatal
                logger.exception("dropped an unreadable message from the API process")
                continue
            if isinstance(message, AddRequest):
                prompt = {"prompt_token_ids": message.prompt_token_ids, "prompt": message.prompt}
                try:
                    requests = engine.make_requests(message.request_id, prompt, message.params, message.priority,
                                                    message.tenant, message.arrival_time)
                except Exception as e:  # noqa: BLE001 - refused requests are answered, never fatal
                    n = message.params.n
                    self.inbox.put(_Refused(message.request_id, e, n, n * len(message.prompt_token_ids)))
                    continue
                self.inbox.put(_Added(requests))
            else:
                self.inbox.put(message)
                if isinstance(message, Shutdown):
                    return

    # -- the busy loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Step while there is work, block on the inbox while there is none; returns on
        ``Shutdown``, raises when a step (or a rank) fails."""
        engine = self.engine
        has_work = False
        busy_since: float | None = None  # the end of the last iteration, while work carries over
        wait: float | None = None
        while True:
            commands = self._take_inbox(None if not has_work else wait)
            start = time.monotonic() if busy_since is None else busy_since
            backlog = engine.scheduler.num_waiting > 0  # as of the last step, before this inbox
            try:
                deltas = self._apply(commands)
            except _Stop:
                return
            waiting_before = (engine.scheduler.num_waiting, waiting_tokens(engine))
            idle = False
            if engine.has_unfinished_requests():
                self._num_step_calls += 1
                if self._num_step_calls == self._fault_inject_step:
                    raise RuntimeError(f"injected fault at engine step {self._num_step_calls}")
                steps_before = engine.stats.num_steps
                progressed = engine.step_requests()
                idle = engine.stats.num_steps == steps_before and not progressed
                deltas.extend(self._delta(pid, children) for pid, children in progressed)
            has_work = engine.has_unfinished_requests()
            end = time.monotonic()
            waiting_after = (engine.scheduler.num_waiting, waiting_tokens(engine))
            snapshot = None
            if not has_work or end - self._snapshot_time >= SNAPSHOT_INTERVAL_S:
                # An engine going idle sends no later snapshot, so its last one must be current.
                self._snapshot = take_snapshot(engine, self._snapshot, refresh=not has_work)
                self._snapshot_time = end
                snapshot = pickle.dumps(self._snapshot)
            self.outputs.send(encode(StepOutputs(
                deltas, waiting_after[0], waiting_after[1], self._applied_seqs, self._applied_tokens,
                start, end, backlog, waiting_before, waiting_after, snapshot)), copy=False)
            busy_since = end if has_work else None
            # Nothing could be scheduled (waiting on KV blocks that no step will free): wait a
            # little for the next command instead of spinning.
            wait = 0.01 if idle else 0.0

    def _take_inbox(self, timeout: float | None) -> list:
        """Everything in the inbox; first waits up to ``timeout`` seconds for one item (None:
        for as long as it takes)."""
        items = []
        if timeout is None or timeout > 0:
            try:
                items.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return items
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def on_fault(self) -> None:
        """A tensor-parallel rank failed between steps (any thread): wake the loop to raise it."""
        self.inbox.put(_HealthCheck())

    def _apply(self, commands: list) -> list[OutputDelta]:
        engine = self.engine
        deltas: list[OutputDelta] = []
        for cmd in commands:
            if isinstance(cmd, _Added):
                requests = cmd.requests
                self._applied_seqs += len(requests)
                self._applied_tokens += len(requests[0].prompt_token_ids) * len(requests)
                try:
                    engine.enqueue(requests)
                except Exception as e:  # noqa: BLE001 - one request that cannot be queued ends alone
                    logger.exception("request %s could not be queued", requests[0].parent_id)
                    engine.abort_request(requests[0].parent_id)
                    deltas.append(_refusal(requests[0].parent_id, e))
            elif isinstance(cmd, _Refused):
                self._applied_seqs += cmd.num_seqs
                self._applied_tokens += cmd.num_tokens
                deltas.append(_refusal(cmd.request_id, cmd.error))
            elif isinstance(cmd, Abort):
                for request_id in cmd.request_ids:
                    children = engine.outputs.parents.get(request_id)
                    if children is not None:
                        engine.abort_request(request_id)
                        deltas.append(self._delta(request_id, children))
            elif isinstance(cmd, _HealthCheck):
                engine.check_health()  # raises: the core dies
            elif isinstance(cmd, Shutdown):
                raise _Stop
        return deltas

    def _delta(self, parent_id: str, children: list[Request]) -> OutputDelta:
        """What is new of a parent request since the last message: read from its samples
        directly, so a step costs the new tokens, not a copy of every output so far."""
        sent = self._sent.get(parent_id)
        if sent is None:  # not setdefault: no throwaway object per request per step
            sent = self._sent[parent_id] = _SentSoFar()
        completions = []
        for r in children:
            text, ids, logprobs = r.output_text, r.output_token_ids, r.logprobs
            text_len, num_tokens, num_logprobs = sent.completions.get(r.index, (0, 0, 0))
            # A stop string can take back text held so far: resend from the common prefix.
            text_offset = min(text_len, len(text))
            completions.append(CompletionDelta(
                r.index, text_offset, text[text_offset:], num_tokens, ids[num_tokens:], r.finish_reason,
                r.stop_reason, num_logprobs,
                None if logprobs is None else [{t: (lp.logprob, lp.rank) for t, lp in entry.items()}
                                               for entry in logprobs[num_logprobs:]]))
            sent.completions[r.index] = (len(text), len(ids), len(logprobs) if logprobs is not None else 0)
        first = children[0]
        prompt_offset = sent.num_prompt_logprobs
        prompt_logprobs = None
        if first.prompt_logprobs is not None and len(first.prompt_logprobs) > prompt_offset:
            prompt_logprobs = [None if entry is None else {t: (lp.logprob, lp.rank) for t, lp in entry.items()}
                               for entry in first.prompt_logprobs[prompt_offset:]]
            sent.num_prompt_logprobs = len(first.prompt_logprobs)
        if len(children) == 1:  # the common case, without parent_state's generality
            finished, error = first.is_finished, first.error
        else:
            finished, error = all(r.is_finished for r in children), next((r.error for r in children if r.error), None)
        # The metrics change at the first token and at the end: sent then, carried over between.
        metrics = None
        if finished or error is not None or not sent.started:
            _, num_cached, error, error_code, m = parent_state(children)
            sent.started = first.first_token_time is not None
            metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_preemptions)
        else:
            num_cached, error_code = max(first.num_cached_tokens, 0), None
        if finished:
            del self._sent[parent_id]
        return OutputDelta(parent_id, completions, finished, num_cached, error, error_code, metrics, prompt_offset,
                           prompt_logprobs)


@dataclass
class _SentSoFar:
    # sample index -> (text chars, token ids, logprobs) already sent
    completions: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    num_prompt_logprobs: int = 0
    started: bool = False  # metrics with a first token time were sent


class _HealthCheck:
    """The loop was idle and a rank reported a failure: raise it on the loop."""


def _refusal(request_id: str, error: BaseException) -> OutputDelta:
    if isinstance(error, InvalidRequestError):
        refusal = ("invalid", error.param, str(error), error.code)
    else:
        refusal = ("error", None, f"{type(error).__name__}: {error}"[:1000], "internal_error")
    return OutputDelta(request_id, [], True, 0, None, None, None, refusal=refusal)
