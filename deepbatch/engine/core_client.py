"""``EngineCoreClient``: the API process's side of the engine core process (``core_process.py``).

    event loop (HTTP)                                    engine core process
    -----------------                                    -------------------
    add_requests: validate + tokenize (thread pool)
      -> AddRequest per prompt ------------------ ZMQ -> input thread -> busy loop
    abort(id) -> Abort ------------------------------->
    reader task <------------------------------- ZMQ -- StepOutputs (one per engine iteration)
      -> rebuild each request's cumulative RequestOutput from the deltas: detokenize the new
         token ids, look for stop strings (a sample that meets one ends here at once:
         FinishSample -> the core stops it too)
      -> observers (metrics, tracing, dashboard), then the RequestStreams
    process sentinel (the core exited) -> every open request fails, dead callbacks run

The frontend validates with the engine's own checks (``LLMEngine.validate`` over the tokenizer,
the model config and the KV cache's size that the core reports in ``Ready``), so a bad request
is refused here with the same error as in one process, before anything is sent. The queue bounds
are checked against the waiting counts of the core's last message plus what was sent since.

The core process is spawned on a GPU (this process has asked the CUDA driver about devices, which
a forked child could not survive) and elsewhere forked where that is safe (it starts at once and
imports nothing again), with the rules of the tensor-parallel workers (``executor/launch.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import pickle
import select
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from deepbatch.config import EngineConfig
from deepbatch.core.errors import EngineDeadError
from deepbatch.engine.core_messages import (
    Abort, AddRequest, Dead, Ready, SetStepDelay, Shutdown, StepOutputs, decode_core_message, encode, wire_params,
)
from deepbatch.engine.core_process import CoreAddresses, run_engine_core, set_process_title
from deepbatch.engine.engine_client import CheckedPrompt, EngineClient
from deepbatch.engine.llm_engine import LLMEngine
from deepbatch.engine.output_assembler import OutputAssembler, refusal_error
from deepbatch.engine.snapshot import EngineSnapshot
from deepbatch.executor.launch import choose_start_method
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.models.config_checks import kv_sliding_window
from deepbatch.models.loader import load_hf_config, load_tokenizer, max_model_len_of, resolve_model
from deepbatch.structured_output.grammar import GrammarCache

logger = logging.getLogger(__name__)

# How long a stop waits for the core to exit before killing it.
_JOIN_S = 10.0
# A step message read this long after the core sent it: the reader is behind (see _read).
_BEHIND_S = 0.05


class Frontend:
    """The model as the API process needs it: config, tokenizer and the engine's request checks,
    no weights. ``validate``, tokenization and chat templates are the engine's own methods, so
    prompts become the same token ids, with the same errors, as in one process."""

    tokenize = LLMEngine.tokenize
    apply_chat_template = LLMEngine.apply_chat_template
    validate = LLMEngine.validate
    prepare_structured_output = LLMEngine.prepare_structured_output
    _prompt_ids = LLMEngine._prompt_ids
    _eos_token_ids = LLMEngine._eos_token_ids

    def __init__(self, config: EngineConfig, ready: Ready):
        self.config = config
        self.source = resolve_model(config.model.model)
        self.hf_config = load_hf_config(self.source, config.model.cache_dir)
        self.tokenizer = load_tokenizer(self.source, config.model.tokenizer, config.model.cache_dir)
        self.max_model_len = max_model_len_of(self.hf_config, config.model.max_model_len)
        self.num_blocks = ready.num_blocks
        # Only its size is read (``blocks_to_fit``): the frontend never allocates blocks.
        self.kv_cache = KVCacheManager(ready.num_blocks, config.cache.block_size, enable_caching=False,
                                       sliding_window=kv_sliding_window(self.hf_config))
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCache(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)

    @property
    def model_name(self) -> str:
        return self.source.name


@dataclass(frozen=True)
class CoreSeat:
    """One of several API processes' place at an engine core started by the launcher: its index
    (its pair in ``addresses``) and the core's pid."""

    index: int
    addresses: CoreAddresses
    core_pid: int


class EngineCoreClient(EngineClient):
    """Observers and dead callbacks run on the event loop."""

    def __init__(self, config: EngineConfig, *, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None, tokenizer_threads: int = 2,
                 fault_inject_step: int | None = None, ready_timeout: float | None = None,
                 seat: CoreSeat | None = None, spawn: bool = False, process_title: bool = True):
        """Start the core process (or, given a ``seat``, join the launcher's) and wait until its
        engine is ready (the model loaded, the KV cache allocated); raises RuntimeError if it
        fails to start. ``spawn``: never fork the core (a host process with threads of its own,
        such as a Ray worker); ``process_title``: name this process ``deepbatch::APIServer``."""
        if seat is None:
            self._dir = tempfile.mkdtemp(prefix="deepbatch-core-")
            addresses, index = CoreAddresses.in_dir(self._dir), 0
        else:
            self._dir = None
            addresses, index = seat.addresses, seat.index
        self._ctx = zmq.Context()
        self._inputs, outputs = bind_client_sockets(self._ctx, addresses, index)
        if seat is None:
            self._core: _OwnCore | _SharedCore = start_core(config, addresses, fault_inject_step, spawn)
            if process_title:
                set_process_title("deepbatch::APIServer")
            # multiprocessing joins a non-daemon child at exit (the core cannot be a daemon: it
            # starts the tensor-parallel workers); an API process that exits without a shutdown
            # stops it first.
            atexit.register(self._reap)
        else:
            self._core = _SharedCore(seat.core_pid)
            set_process_title(f"deepbatch::APIServer_{index}")
        ready = self._wait_ready(outputs, ready_timeout)
        self._sync_outputs = outputs  # read by the reader task, through an asyncio shadow
        self._send_lock = threading.Lock()  # a ZMQ socket is not thread-safe; shutdown may run off the loop
        super().__init__(Frontend(config, ready), max_queued_requests=max_queued_requests,
                         max_queued_tokens=max_queued_tokens, tokenizer_threads=tokenizer_threads)
        self._cache_info = ready.cache_info
        self._snapshot: EngineSnapshot = pickle.loads(ready.snapshot)
        self._sent_seqs = self._sent_tokens = 0  # of every AddRequest sent
        self._applied_seqs = self._applied_tokens = 0  # of those, applied by the core (its last message)
        self._num_waiting = self._num_waiting_tokens = 0
        # The text is made here.
        self._assembler = OutputAssembler(self.engine.tokenizer, config.fault_inject_detokenize_request)
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False  # shutdown asked for: the core's exit is no death

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> EngineCoreClient:
        return cls(config, **kwargs)

    def _wait_ready(self, outputs, timeout: float | None) -> Ready:
        try:
            return wait_ready(outputs, self._core, timeout)
        except RuntimeError:
            self._reap()
            raise

    # -- read-only views ----------------------------------------------------------------------------

    @property
    def cache_info(self) -> dict[str, str] | None:
        return self._cache_info

    def snapshot(self) -> EngineSnapshot:
        """The core's newest counters; requests on their way there count as waiting."""
        pending = self._sent_seqs - self._applied_seqs
        snap = self._snapshot
        return replace(snap, num_waiting=snap.num_waiting + pending) if pending else snap

    def _queued(self) -> tuple[int, int]:
        return (self._num_waiting + self._sent_seqs - self._applied_seqs,
                self._num_waiting_tokens + self._sent_tokens - self._applied_tokens)

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading the core's messages (on the running event loop)."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read(zmq.asyncio.Socket.from_socket(self._sync_outputs)))
        # Readable when the core exits, whatever the cause (SIGKILL too).
        self._loop.add_reader(self._core.fileno(), self._on_core_exit)

    def shutdown(self, timeout: float = _JOIN_S) -> None:
        """Stop the core after the step in progress (idempotent; any thread); a core shared with
        other API processes only drops this one's requests (the launcher stops it). Requests
        still open end with EngineDeadError."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        if isinstance(self._core, _OwnCore):
            self._send(Shutdown())
            self._core.process.join(timeout)
        else:
            # The streams belong to the event loop; list() copies the dict without releasing the
            # interpreter lock, so the copy is whole even from another thread.
            self._send(Abort(list(self._streams)))
        self._reap()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._end, EngineDeadError("the engine was shut down"))
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _reap(self) -> None:
        if isinstance(self._core, _OwnCore) and self._core.process.is_alive():
            logger.warning("the engine core did not stop; killing it")
            self._core.process.kill()
            self._core.process.join(5)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self._core.fileno())
        if self._stopped:
            return
        # Messages the core sent before it exited (its Dead, with the cause) are read first.
        self._core.join(1.0)
        self._loop.call_later(0.5, self._end, EngineDeadError(
            f"the engine core process {self._core.exit_status()}"))

    def _end(self, error: EngineDeadError) -> None:
        """Fail every open request; without a shutdown asked for, the engine is dead."""
        if self._reader is not None:
            self._reader.cancel()
        if not self._stopped and self._dead is None:
            logger.error("%s", error)
            self._dead = error
            self._run_dead_callbacks(error)
        self._deliver_error([(stream, self._dead or error) for stream in list(self._streams.values())])
        self._assembler.clear()

    # -- requests -------------------------------------------------------------------------------------

    def _check_prompt(self, request_id, prompt, params, priority, tenant, arrival) -> tuple[str | None, list[int]]:
        text, ids, _ = self.engine.validate(prompt, params)
        return text, ids

    def _submit(self, adds: list[CheckedPrompt], num_seqs: int, num_tokens: int) -> None:
        self._check_accepting(num_seqs, num_tokens)
        params = wire_params(adds[0].params)  # one API call: the prompts share their params
        for add in adds:
            ids, text = add.prompt["prompt_token_ids"], add.prompt["prompt"]
            self._send(AddRequest(add.request_id, ids, text, params, add.priority, add.tenant, add.arrival_time))
            self._assembler.add(add.request_id, text, ids, add.tenant, params)
        self._sent_seqs += num_seqs
        self._sent_tokens += num_tokens

    def abort(self, request_id: str) -> None:
        if self._dead is None and not self._stopped:
            self._send(Abort([request_id]))

    def set_step_delay(self, seconds: float) -> None:
        """Testing only: the core sleeps ``seconds`` before every model step from now on."""
        self._send(SetStepDelay(seconds))

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._inputs.send(encode(message), zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # the core is gone; its exit fails the open requests
                pass

    # -- the reader task --------------------------------------------------------------------------------

    async def _read(self, socket) -> None:
        try:
            while True:
                message = decode_core_message(await socket.recv(copy=False))
                if isinstance(message, StepOutputs):
                    self._on_step(message)
                    # Let the streams take this step's outputs before the next message, so a
                    # client gets a chunk per step. A reader that fell behind (the message
                    # waited) takes the next one at once instead: the streams then send the
                    # steps it caught up on as one chunk, and the process catches up rather
                    # than falling further behind with a write per stream per step.
                    if time.monotonic() - message.end < _BEHIND_S:
                        await asyncio.sleep(0)
                elif isinstance(message, Dead):
                    self._end(EngineDeadError(message.message))
                    return
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - a message we cannot read: the link is broken
            logger.exception("reading the engine core's messages failed")
            self._end(EngineDeadError(f"lost the engine core: {type(e).__name__}: {e}"))

    def _on_step(self, message: StepOutputs) -> None:
        self._num_waiting, self._num_waiting_tokens = message.waiting_after
        self._applied_seqs, self._applied_tokens = message.applied_seqs, message.applied_tokens
        self._bounds.observe(message.start, message.end, message.backlog, message.waiting_before,
                             message.waiting_after)
        if message.snapshot is not None:
            self._snapshot = pickle.loads(message.snapshot)
        outputs, pairs, errors = [], [], []
        for delta in message.outputs:
            stream = self._streams.get(delta.request_id)
            if delta.refusal is not None:
                self._assembler.drop(delta.request_id)
                if stream is not None:
                    errors.append((stream, refusal_error(delta.refusal)))
                continue
            out, finishes = self._assembler.apply(delta)
            for finish in finishes:  # a stop string in the text: the core stops the sample too
                self._send(finish)
            outputs.append(out)
            if stream is not None:
                pairs.append((stream, out))
        if outputs:
            self._notify_observers(outputs)
        self._deliver(pairs)
        self._deliver_error(errors)


def bind_client_sockets(ctx, addresses: CoreAddresses, index: int = 0):
    """The client's (PUSH to the core, PULL from it) sockets of pair ``index``, bound, without
    high-water marks (neither side may stall on the other) or lingering."""
    sockets = []
    for kind, hwm, address in ((zmq.PUSH, zmq.SNDHWM, addresses.inputs[index]),
                               (zmq.PULL, zmq.RCVHWM, addresses.outputs[index])):
        socket = ctx.socket(kind)
        socket.setsockopt(hwm, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(address)
        sockets.append(socket)
    return tuple(sockets)


def start_core(config: EngineConfig, addresses: CoreAddresses, fault_inject_step: int | None = None,
               spawn: bool = False) -> _OwnCore:
    """The engine core as a child of this process, on ``addresses`` (bound here first); ``spawn``:
    never forked (a process that may have run torch's thread pools: a fork of it can hang)."""
    # A CUDA core is spawned: this process asked the driver about devices while it built the
    # config, and a forked child of such a process cannot use CUDA.
    mp = multiprocessing.get_context("spawn" if spawn or config.device != "cpu" else choose_start_method())
    process = mp.Process(target=run_engine_core, name="deepbatch::EngineCore",
                         args=(config, addresses, fault_inject_step, os.getpid()), daemon=False)
    process.start()
    return _OwnCore(process)


def wait_ready(outputs, core: _OwnCore | _SharedCore, timeout: float | None) -> Ready:
    """The core's ``Ready`` from the ``outputs`` socket; RuntimeError (the caller stops the core)
    when it failed, exited or took longer than ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if outputs.poll(500):
            message = decode_core_message(outputs.recv())
            if isinstance(message, Ready):
                logger.info("engine core ready (pid %d, %d KV blocks)", message.pid, message.num_blocks)
                return message
            if isinstance(message, Dead):
                raise RuntimeError(message.message)
        if not core.is_alive():
            raise RuntimeError(f"the engine core process {core.exit_status()} before it was ready")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"the engine core was not ready after {timeout} s")


class _OwnCore:
    """The core as this process's child."""

    def __init__(self, process):
        self.process = process

    def fileno(self) -> int:
        return self.process.sentinel  # readable once the process has exited

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def exit_status(self) -> str:
        return f"exited unexpectedly (exit code {self.process.exitcode})"


class _SharedCore:
    """The launcher's core, watched through a pid file descriptor (readable once it has exited;
    its exit code is the launcher's to read). The descriptor lives as long as this process."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd = os.pidfd_open(pid)

    def fileno(self) -> int:
        return self._fd

    def is_alive(self) -> bool:
        return not select.select([self._fd], [], [], 0)[0]

    def join(self, timeout: float) -> None:
        select.select([self._fd], [], [], timeout)

    def exit_status(self) -> str:
        return f"(pid {self.pid}) exited unexpectedly"
