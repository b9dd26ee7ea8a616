"""The offline engine (``LLM``) over the engine core process: the split ``deepbatch serve`` uses,
without HTTP or an event loop.

    LLM.generate (this process)                          deepbatch::EngineCore
    ---------------------------                          ---------------------
    validate + tokenize every prompt (Frontend)
    AddRequest per sample group ----------------- ZMQ -> busy loop: schedule, run, sample
    take StepOutputs <---------------------------- ZMQ -- one per engine iteration (token ids)
      detokenize, stop strings (OutputAssembler) -> FinishSample for a sample a stop string ended
      finished outputs -> the caller

What moves off the stepping thread is the per-token Python work of text: detokenization, stop
strings, building each output. ``LLM`` takes this path where ``DEEPBATCH_LLM_ENGINE_PROCESS=1``,
an opt-in: it measured 98% of the engine stepped in the calling process on an H100 and 94% on
two CPU cores (docs/benchmarks.md), the message per step each way costing about what it moves.
The engine is then out of reach (``LLM.engine`` is the ``Frontend``: tokenizer, config and the
engine's request checks, no model).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import shutil
import tempfile
import threading
import time

import zmq

from deepbatch.config import EngineConfig
from deepbatch.core.errors import EngineDeadError
from deepbatch.core.outputs import RequestOutput
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.engine.core_client import Frontend, bind_client_sockets, start_core, wait_ready
from deepbatch.engine.core_messages import (
    Abort, AddRequest, Dead, Shutdown, StepOutputs, decode_core_message, encode, wire_params,
)
from deepbatch.engine.core_process import CoreAddresses
from deepbatch.engine.output_assembler import OutputAssembler, refusal_error

logger = logging.getLogger(__name__)

_JOIN_S = 10.0
_POLL_MS = 200  # how often a wait for the core's next message looks whether it is still alive


class OfflineCoreClient:
    """Requests in, finished outputs out, through an engine core process this object starts."""

    def __init__(self, config: EngineConfig, ready_timeout: float | None = None):
        self._dir = tempfile.mkdtemp(prefix="deepbatch-core-")
        addresses = CoreAddresses.in_dir(self._dir)
        self._ctx = zmq.Context()
        self._inputs, self._outputs = bind_client_sockets(self._ctx, addresses)
        # Spawned, never forked: the caller may have run torch ops on its thread pools (a fork
        # of such a process can hang in them), so a script creates the LLM under
        # ``if __name__ == "__main__":``, as with tensor parallelism.
        self._core = start_core(config, addresses, spawn=True)
        self._stopped = False
        self._lock = threading.Lock()
        atexit.register(self.shutdown)
        try:
            ready = wait_ready(self._outputs, self._core, ready_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.frontend = Frontend(config, ready)
        self._assembler = OutputAssembler(self.frontend.tokenizer, config.fault_inject_detokenize_request)
        self._ids = itertools.count()
        self._open: set[str] = set()

    # -- requests ---------------------------------------------------------------------------

    def check(self, prompt, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """The prompt's text and token ids and the params to send (a grammar compiled here, so
        a bad one is refused before anything is queued), or InvalidRequestError."""
        if params.structured_outputs is not None:
            params = self.frontend.prepare_structured_output(params)
        text, ids, _ = self.frontend.validate(prompt, params)
        return text, ids, params

    def add(self, text: str | None, ids: list[int], params: SamplingParams, priority: int = 0) -> str:
        """Queue one checked prompt; returns its request id."""
        request_id = str(next(self._ids))
        self._send(AddRequest(request_id, ids, text, wire_params(params), priority, "default", time.monotonic()))
        self._assembler.add(request_id, text, ids, "default", params)
        self._open.add(request_id)
        return request_id

    def abort(self, request_ids) -> None:
        ids = [r for r in request_ids if r in self._open]
        if ids and not self._stopped:
            self._send(Abort(ids))

    @property
    def num_open(self) -> int:
        return len(self._open)

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next iteration that finished a request (waits for it).
        A request the core refused raises its error; a dead core raises EngineDeadError."""
        while not self._outputs.poll(_POLL_MS):
            if not self._core.is_alive():
                self.shutdown()
                raise EngineDeadError(f"the engine core process {self._core.exit_status()}")
        message = decode_core_message(self._outputs.recv(copy=False))
        if isinstance(message, Dead):
            self.shutdown()
            raise EngineDeadError(message.message)
        assert isinstance(message, StepOutputs)
        finished, refused = [], None
        for delta in message.outputs:
            if delta.refusal is not None:
                self._assembler.drop(delta.request_id)
                self._open.discard(delta.request_id)
                refused = refused or refusal_error(delta.refusal)
                continue
            out, finishes = self._assembler.apply(delta)
            for finish in finishes:  # a stop string in the text: the core stops the sample too
                self._send(finish)
            if out.finished:
                self._open.discard(delta.request_id)
                finished.append(out)
        if refused is not None:
            raise refused
        return finished

    # -- lifecycle --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the core (idempotent); requests still open are dropped."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.shutdown)
        self._send(Shutdown(), force=True)
        self._core.process.join(_JOIN_S)
        if self._core.process.is_alive():
            logger.warning("the engine core did not stop; killing it")
            self._core.process.kill()
            self._core.process.join(5)
        self._inputs.close(0)
        self._outputs.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _send(self, message, force: bool = False) -> None:
        if self._stopped and not force:
            return
        try:
            self._inputs.send(encode(message), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the core is gone; the next wait for its message says so
            pass
