"""``EngineCoreClient``: the API process's side of the engine core process (``core_process.py``).

    event loop (HTTP)                                    engine core process
    -----------------                                    -------------------
    add_requests: validate + tokenize (thread pool)
      -> AddRequest per prompt ------------------ ZMQ -> input thread -> busy loop
    abort(id) -> Abort ------------------------------->
    reader task <------------------------------- ZMQ -- StepOutputs (one per engine iteration)
      -> rebuild each request's cumulative RequestOutput from the deltas
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
import shutil
import tempfile
import threading
import time
from dataclasses import replace

import zmq
import zmq.asyncio

from deepbatch.config import EngineConfig
from deepbatch.core.errors import EngineDeadError, InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepbatch.engine.core_messages import (
    Abort, AddRequest, CompletionDelta, Dead, OutputDelta, Ready, Shutdown, StepOutputs, decode_core_message, encode,
    wire_params,
)
from deepbatch.engine.core_process import CoreAddresses, run_engine_core, set_process_title
from deepbatch.engine.engine_client import CheckedPrompt, EngineClient
from deepbatch.engine.llm_engine import LLMEngine
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


class EngineCoreClient(EngineClient):
    """Observers and dead callbacks run on the event loop."""

    def __init__(self, config: EngineConfig, *, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None, tokenizer_threads: int = 2,
                 fault_inject_step: int | None = None, ready_timeout: float | None = None):
        """Start the core process and wait until its engine is ready (the model loaded, the KV
        cache allocated); raises RuntimeError if it fails to start."""
        self._dir = tempfile.mkdtemp(prefix="deepbatch-core-")
        addresses = CoreAddresses(f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs")
        self._ctx = zmq.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.setsockopt(zmq.LINGER, 0)
        self._inputs.bind(addresses.inputs)
        outputs = self._ctx.socket(zmq.PULL)
        outputs.setsockopt(zmq.RCVHWM, 0)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.bind(addresses.outputs)
        # A CUDA core is spawned: this process asked the driver about devices while it built the
        # config, and a forked child of such a process cannot use CUDA.
        mp = multiprocessing.get_context("spawn" if config.device != "cpu" else choose_start_method())
        self.process = mp.Process(target=run_engine_core, name="deepbatch::EngineCore",
                                  args=(config, addresses, fault_inject_step, os.getpid()), daemon=False)
        self.process.start()
        set_process_title("deepbatch::APIServer")
        # multiprocessing joins a non-daemon child at exit (the core cannot be a daemon: it starts
        # the tensor-parallel workers); an API process that exits without a shutdown stops it first.
        atexit.register(self._reap)
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
        self._assembler = OutputAssembler()
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False  # shutdown asked for: the core's exit is no death

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> EngineCoreClient:
        return cls(config, **kwargs)

    def _wait_ready(self, outputs, timeout: float | None) -> Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if outputs.poll(500):
                message = decode_core_message(outputs.recv())
                if isinstance(message, Ready):
                    logger.info("engine core ready (pid %d, %d KV blocks)", message.pid, message.num_blocks)
                    return message
                if isinstance(message, Dead):
                    self._reap()
                    raise RuntimeError(message.message)
            if not self.process.is_alive():
                self._reap()
                raise RuntimeError(f"the engine core process exited with {self.process.exitcode} before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                self._reap()
                raise RuntimeError(f"the engine core was not ready after {timeout} s")

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
        # The process's sentinel turns readable when it exits, whatever the cause (SIGKILL too).
        self._loop.add_reader(self.process.sentinel, self._on_core_exit)

    def shutdown(self, timeout: float = _JOIN_S) -> None:
        """Stop the core after the step in progress (idempotent; any thread). Requests still open
        end with EngineDeadError."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        self._send(Shutdown())
        self.process.join(timeout)
        self._reap()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._end, EngineDeadError("the engine was shut down"))
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _reap(self) -> None:
        if self.process.is_alive():
            logger.warning("the engine core did not stop; killing it")
            self.process.kill()
            self.process.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _on_core_exit(self) -> None:
        self._loop.remove_reader(self.process.sentinel)
        if self._stopped:
            return
        # Messages the core sent before it exited (its Dead, with the cause) are read first.
        self.process.join(1.0)
        self._loop.call_later(0.5, self._end, EngineDeadError(
            f"the engine core process exited unexpectedly (exit code {self.process.exitcode})"))

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
            self._assembler.add(add.request_id, text, ids, add.tenant)
        self._sent_seqs += num_seqs
        self._sent_tokens += num_tokens

    def abort(self, request_id: str) -> None:
        if self._dead is None and not self._stopped:
            self._send(Abort([request_id]))

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
        self._num_waiting, self._num_waiting_tokens = message.num_waiting, message.num_waiting_tokens
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
                    errors.append((stream, _refusal_error(delta.refusal)))
                continue
            out = self._assembler.apply(delta)
            outputs.append(out)
            if stream is not None:
                pairs.append((stream, out))
        if outputs:
            self._notify_observers(outputs)
        self._deliver(pairs)
        self._deliver_error(errors)

class OutputAssembler:
    """Each request's cumulative ``RequestOutput``, rebuilt from the core's deltas."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}  # parent id -> its output so far

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], tenant: str) -> None:
        """A request sent to the core: what its deltas are applied to (they carry no prompt)."""
        self._outputs[request_id] = RequestOutput(request_id, prompt, prompt_token_ids, tenant=tenant)

    def drop(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)

    def clear(self) -> None:
        self._outputs.clear()

    def apply(self, delta: OutputDelta) -> RequestOutput:
        """The request's cumulative output with ``delta`` applied (a new object each time: a
        stream holds the newest output and a reader may still be looking at the previous one)."""
        previous = self._outputs.get(delta.request_id)
        if previous is None:  # not added here (cannot happen while the link is whole): no prompt to carry
            previous = RequestOutput(delta.request_id, None, [])
        before = previous.outputs
        if len(delta.completions) == 1 and len(before) <= 1:  # one sample: no index map needed
            completions = [_applied(before[0] if before else None, delta.completions[0])]
        else:
            by_index = {c.index: c for c in before}
            for c in delta.completions:
                by_index[c.index] = _applied(by_index.get(c.index), c)
            completions = [by_index[i] for i in sorted(by_index)]
        prompt_logprobs = previous.prompt_logprobs
        if delta.prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs or [])[:delta.prompt_logprobs_offset] + [
                None if entry is None else {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()}
                for entry in delta.prompt_logprobs]
        m = delta.metrics
        out = RequestOutput(
            request_id=delta.request_id, prompt=previous.prompt, prompt_token_ids=previous.prompt_token_ids,
            outputs=completions, finished=delta.finished, num_cached_tokens=delta.num_cached_tokens,
            error=delta.error, error_code=delta.error_code,
            metrics=RequestMetrics(*m) if m is not None else previous.metrics, tenant=previous.tenant,
            prompt_logprobs=prompt_logprobs)
        if delta.finished:
            self._outputs.pop(delta.request_id, None)
        else:
            self._outputs[delta.request_id] = out
        return out


def _applied(before: CompletionOutput | None, c: CompletionDelta) -> CompletionOutput:
    """One sample's output with its delta applied."""
    if before is None:
        text, token_ids, logprobs = c.text, c.token_ids, None
    else:
        text = before.text + c.text if c.text_offset == len(before.text) else before.text[:c.text_offset] + c.text
        token_ids = before.token_ids[:c.token_offset] + c.token_ids
        logprobs = before.logprobs
    if c.logprobs is not None:
        logprobs = (logprobs or [])[:c.logprobs_offset] + [
            {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()} for entry in c.logprobs]
    return CompletionOutput(c.index, text, token_ids, c.finish_reason, c.stop_reason, logprobs)


def _refusal_error(refusal: tuple[str, str | None, str, str]) -> Exception:
    kind, param, message, code = refusal
    if kind == "invalid":
        error = InvalidRequestError(None, message, code)
        error.param = param
        return error
    return RuntimeError(message)
