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

Several API processes can share one core (``deepbatch serve --api-server-count N``): each has its
own pair of sockets, the input thread polls them all, and each step's outputs are split by the
API process that sent each request, every one of them getting one message per step (with the
waiting counts its queue bounds read). Request ids are unique across them: an id already held
by one is refused to another as a duplicate, as it would be within one.

The core exits when its parent asks (``Shutdown``), when its parent is gone (its pid is no
longer our parent: a killed server leaves no engine holding the GPU), and when a step fails
(after sending ``Dead``). The parent is the API process, or with several of them the launcher
(``deepbatch/api/launcher.py``). SIGINT and SIGTERM are ignored: the API processes drain first
and then the core is asked to stop, so a signal sent to the whole process group does not cut the
drain.
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
from dataclasses import dataclass

import zmq

from deepbatch.config import EngineConfig
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.request import Request
from deepbatch.engine.core_messages import (
    SNAPSHOT_INTERVAL_S, Abort, AddRequest, Dead, FinishSample, OutputDelta, Ready, SetStepDelay, Shutdown,
    StepOutputs, decode_client_message, encode,
)
from deepbatch.engine.core_deltas import OutputDeltas, refusal
from deepbatch.engine.snapshot import EngineSnapshot, cache_config_info, take_snapshot, waiting_tokens

logger = logging.getLogger("deepbatch.engine_core")

# How often the input thread checks that the API process is still there.
_PARENT_POLL_MS = 200


@dataclass(frozen=True)
class CoreAddresses:
    """ZMQ endpoints, one pair per API process: the core PULLs ``inputs[i]`` and PUSHes
    ``outputs[i]``; API process ``i`` binds both."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def in_dir(cls, directory: str, num_clients: int = 1) -> CoreAddresses:
        return cls(tuple(f"ipc://{directory}/inputs-{i}" for i in range(num_clients)),
                   tuple(f"ipc://{directory}/outputs-{i}" for i in range(num_clients)))


@dataclass
class _Added:
    requests: list[Request]
    client: int = 0  # the API process that sent it


@dataclass
class _Refused:
    request_id: str
    error: BaseException
    num_seqs: int  # what the API process counted as on its way to the queue
    num_tokens: int
    client: int = 0
    duplicate: bool = False  # the id is held by a request of another API process


@dataclass
class _FromClient:
    """An ``Abort`` or ``FinishSample`` from one of several API processes."""

    message: Abort | FinishSample
    client: int


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
    # No high-water marks: a busy API process must never stall the engine's loop on a send.
    outputs = [_connected(out_ctx, zmq.PUSH, zmq.SNDHWM, 2000, address) for address in addresses.outputs]
    inputs = [_connected(ctx, zmq.PULL, zmq.RCVHWM, 0, address) for address in addresses.inputs]
    engine = None
    try:
        import torch

        from deepbatch.engine.llm_engine import LLMEngine

        torch.manual_seed(config.model.seed)
        engine = LLMEngine(config, detokenize=False)  # text is the API processes' work
        core = EngineCore(engine, outputs, fault_inject_step)
        # The model, the tokenizer and the modules stay for the process's life: out of the
        # collector's generations, the objects each step creates are collected without them.
        gc.collect()
        gc.freeze()
        ready = encode(core.ready())
        for socket in outputs:
            socket.send(ready)
        threading.Thread(target=core.read_inputs, args=(inputs, parent_pid), name="deepbatch-core-input",
                         daemon=True).start()
        core.run()
    except BaseException as e:  # noqa: BLE001 - the API process must hear why; then exit non-zero
        logger.error("the engine core failed", exc_info=e)
        message = f"the engine stopped after an error in a model step: {type(e).__name__}: {e}"[:1000]
        _send_quietly(outputs, Dead(message))
        _stop_engine(engine)
        for socket in outputs:
            socket.close(linger=2000)
        out_ctx.term()  # waits until Dead is delivered (or 2 s)
        os._exit(1)  # the input thread may sit in a socket call; nothing else needs to run
    _stop_engine(engine)
    _send_quietly(outputs, Dead("the engine was shut down"))
    for socket in outputs:
        socket.close(linger=2000)
    out_ctx.term()
    for socket in inputs:
        socket.close()
    ctx.term()


def _connected(ctx, kind: int, hwm_option: int, linger_ms: int, address: str):
    socket = ctx.socket(kind)
    socket.setsockopt(hwm_option, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)
    socket.connect(address)
    return socket


def _stop_engine(engine) -> None:
    """Stop the tensor-parallel workers, if any."""
    if engine is None:
        return
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        logger.exception("stopping the engine failed")


def _send_quietly(sockets, message) -> None:
    data = encode(message)
    for socket in sockets:
        try:
            socket.send(data, zmq.NOBLOCK)
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
        """``outputs``: the PUSH socket to each API process (one socket alone: one API process)."""
        self.engine = engine
        self.outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._fault_inject_step = fault_inject_step
        self._num_step_calls = 0
        self.step_delay_s = 0.0  # testing only (SetStepDelay)
        self._deltas = OutputDeltas()
        # Sequences and prompt tokens of every AddRequest applied so far, per API process.
        self._applied = [[0, 0] for _ in self.outputs]
        # With several API processes: parent id -> the one that sent it (written by the input
        # thread when a request arrives, removed by the loop when its last output leaves).
        self._owner: dict[str, int] = {}
        self._routed: list[tuple[int, OutputDelta]] = []  # refusals, to whoever sent the request
        self._snapshot = EngineSnapshot()
        self._snapshot_time = 0.0
        engine.add_fault_listener(self.on_fault)

    def ready(self) -> Ready:
        self._snapshot = take_snapshot(self.engine, self._snapshot, refresh=True)
        return Ready(os.getpid(), self.engine.num_blocks, cache_config_info(self.engine), pickle.dumps(self._snapshot))

    # -- the input thread -------------------------------------------------------------------------

    def read_inputs(self, sockets, parent_pid: int) -> None:
        """``sockets``: the PULL socket from each API process, in the order of ``outputs``."""
        sockets = list(sockets) if isinstance(sockets, (list, tuple)) else [sockets]
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        client_of = {socket: i for i, socket in enumerate(sockets)}
        while True:
            ready = poller.poll(_PARENT_POLL_MS)
            if not ready:
                if os.getppid() != parent_pid:
                    logger.error("the parent process (pid %d) is gone; stopping the engine core", parent_pid)
                    self.inbox.put(Shutdown())
                    return
                continue
            for socket, _ in ready:
                try:
                    message = decode_client_message(socket.recv())
                except Exception:  # noqa: BLE001 - a message we cannot read is dropped, never fatal
                    logger.exception("dropped an unreadable message from an API process")
                    continue
                if self._take(message, client_of[socket]):
                    return

    def _take(self, message, client: int) -> bool:
        """One message from API process ``client`` into the inbox; True on ``Shutdown``."""
        if isinstance(message, AddRequest):
            n = message.params.n
            if len(self.outputs) > 1:
                if message.request_id in self._owner:
                    error = InvalidRequestError("request_id", f"request id {message.request_id!r} is already in use",
                                                code="duplicate_request_id")
                    self.inbox.put(_Refused(message.request_id, error, n, n * len(message.prompt_token_ids), client,
                                            duplicate=True))
                    return False
                self._owner[message.request_id] = client
            prompt = {"prompt_token_ids": message.prompt_token_ids, "prompt": message.prompt}
            try:
                requests = self.engine.make_requests(message.request_id, prompt, message.params, message.priority,
                                                     message.tenant, message.arrival_time)
            except Exception as e:  # noqa: BLE001 - refused requests are answered, never fatal
                self.inbox.put(_Refused(message.request_id, e, n, n * len(message.prompt_token_ids), client))
                return False
            self.inbox.put(_Added(requests, client))
        elif isinstance(message, SetStepDelay):
            self.step_delay_s = max(0.0, message.seconds)  # one attribute: the loop reads it each step
        elif isinstance(message, (Abort, FinishSample)) and len(self.outputs) > 1:
            self.inbox.put(_FromClient(message, client))
        else:
            self.inbox.put(message)
            return isinstance(message, Shutdown)
        return False

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
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                steps_before = engine.stats.num_steps
                progressed = engine.step_requests()
                idle = engine.stats.num_steps == steps_before and not progressed
                deltas.extend(self._deltas(pid, children) for pid, children in progressed)
            has_work = engine.has_unfinished_requests()
            end = time.monotonic()
            waiting_after = (engine.scheduler.num_waiting, waiting_tokens(engine))
            snapshot = None
            if not has_work or end - self._snapshot_time >= SNAPSHOT_INTERVAL_S:
                # An engine going idle sends no later snapshot, so its last one must be current.
                self._snapshot = take_snapshot(engine, self._snapshot, refresh=not has_work)
                self._snapshot_time = end
                snapshot = pickle.dumps(self._snapshot)
            for client, client_deltas in self._route(deltas):
                applied = self._applied[client]
                self.outputs[client].send(encode(StepOutputs(
                    client_deltas, applied[0], applied[1],
                    start, end, backlog, waiting_before, waiting_after, snapshot)), copy=False)
            busy_since = end if has_work else None
            # Nothing could be scheduled (waiting on KV blocks that no step will free): wait a
            # little for the next command instead of spinning.
            wait = 0.01 if idle else 0.0

    def _route(self, deltas: list[OutputDelta]) -> list[tuple[int, list[OutputDelta]]]:
        """Each API process with its share of one step's outputs (every one gets a message)."""
        if len(self.outputs) == 1:
            return [(0, deltas)]
        shares: list[list[OutputDelta]] = [[] for _ in self.outputs]
        for client, delta in self._routed:
            shares[client].append(delta)
        self._routed.clear()
        owner = self._owner
        for delta in deltas:
            client = owner.pop(delta.request_id, None) if delta.finished else owner.get(delta.request_id)
            if client is None:  # cannot happen: every request arrives through _take
                logger.error("no API process holds request %s; its output is dropped", delta.request_id)
                continue
            shares[client].append(delta)
        return list(enumerate(shares))

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
                applied = self._applied[cmd.client]
                applied[0] += len(requests)
                applied[1] += len(requests[0].prompt_token_ids) * len(requests)
                try:
                    engine.enqueue(requests)
                except Exception as e:  # noqa: BLE001 - one request that cannot be queued ends alone
                    logger.exception("request %s could not be queued", requests[0].parent_id)
                    engine.abort_request(requests[0].parent_id)
                    deltas.append(refusal(requests[0].parent_id, e))
            elif isinstance(cmd, _Refused):
                applied = self._applied[cmd.client]
                applied[0] += cmd.num_seqs
                applied[1] += cmd.num_tokens
                answer = refusal(cmd.request_id, cmd.error)
                if len(self.outputs) == 1:
                    deltas.append(answer)
                else:  # answered to the sender only: a duplicate id is held by another request
                    self._routed.append((cmd.client, answer))
                    if not cmd.duplicate:
                        self._owner.pop(cmd.request_id, None)
            elif isinstance(cmd, (Abort, FinishSample, _FromClient)):
                # From one of several API processes: only the requests it sent.
                sender = cmd.client if isinstance(cmd, _FromClient) else None
                message = cmd.message if isinstance(cmd, _FromClient) else cmd
                if isinstance(message, FinishSample):
                    if sender is None or self._owner.get(message.request_id) == sender:
                        children = engine.outputs.finish_sample(message.request_id, message.index,
                                                                message.stop_reason, message.error)
                        if children is not None:
                            deltas.append(self._deltas(message.request_id, children))
                    continue
                for request_id in message.request_ids:
                    children = engine.outputs.parents.get(request_id)
                    if children is not None and (sender is None or self._owner.get(request_id) == sender):
                        engine.abort_request(request_id)
                        deltas.append(self._deltas(request_id, children))
            elif isinstance(cmd, _HealthCheck):
                engine.check_health()  # raises: the core dies
            elif isinstance(cmd, Shutdown):
                raise _Stop
        return deltas


class _HealthCheck:
    """The loop was idle and a rank reported a failure: raise it on the loop."""
