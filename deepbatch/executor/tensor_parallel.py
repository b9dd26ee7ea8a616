"""Rank 0 of a tensor-parallel engine: spawns the workers, holds its own model shard, and runs
each step on all ranks. ``LLMEngine`` uses it where it would use a ``ModelRunner``.

    rank 0 (engine process)                         rank r >= 1 (worker process)
    -----------------------                         ----------------------------
    schedule() -> SchedulerOutput
    launch(out):
      msg = builder.build(out)   -- queue ------>   msg = inbox.get()
      forward(out)                <== all-reduce ==>  forward(mirror.apply(msg))
      logits (vocab shards)       <== gather =====    logits shard
      sample on rank 0
      sampled ids                 == broadcast ==>    sampled ids (a pending input's source)
    commit the sampled tokens

Messages travel on one ``multiprocessing`` queue per worker: ``put`` never blocks (a feeder thread
writes the pipe), so a stalled worker cannot stall rank 0 outside a collective, and every
collective has a timeout. Any failure (a collective that fails or times out, a worker that exits)
makes the executor dead for good: it kills the remaining workers and every later call raises
``EngineDeadError``. How workers start, where their output goes and how they stop is
``launch``'s concern; a stop that was asked for (``shutdown``, the executor collected, interpreter
exit) is never reported as a death.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from deepbatch.config import EngineConfig
from deepbatch.executor.launch import WorkerGroup, check_not_importing_main
from deepbatch.distributed.messages import RunnerCallMessage, StepMessageBuilder
from deepbatch.distributed.parallel_state import (STARTUP_TIMEOUT_S, building_for, init_tensor_parallel_group,
                                                  joined_key, loaded_key)
from deepbatch.runner.worker import WorkerArgs
from deepbatch.core.errors import EngineDeadError
from deepbatch.models.loader import ModelSource, build_model
from deepbatch.runner.model_runner import ModelRunner
from deepbatch.sampling.pending_sample import PendingSample
from deepbatch.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_STORE_HOST = "127.0.0.1"
_STARTUP_POLL_S = 0.05


def _weak_callback(method: Callable[..., None]) -> Callable[..., None]:
    """Call ``method`` while its object lives: the watchdog's thread must not keep the executor
    alive, or an engine that goes out of scope would never stop its workers."""
    ref = weakref.WeakMethod(method)

    def call(*args) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, max_model_len: int):
        check_not_importing_main()
        parallel = config.parallel
        size = parallel.tensor_parallel_size
        if config.device.startswith("cuda"):
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size: {size} ranks need {size} GPUs, "
                                 f"found {torch.cuda.device_count()}")
        self.config = config
        self._lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._fault_listeners: list[Callable[[], None]] = []
        self._builder = StepMessageBuilder()
        # The workers start before the store: its server is a thread, and a process is forked
        # safely only while it runs one (``launch``).
        self._workers = WorkerGroup(size, lambda rank: WorkerArgs(rank, size, _STORE_HOST, config, source,
                                                                  hf_config, max_model_len))
        # The workers hold nothing of the executor, so dropping the engine stops them.
        weakref.finalize(self, self._workers.stop)
        try:
            # Port 0: the OS picks a free port; each worker's first message names it.
            self._store = dist.TCPStore(_STORE_HOST, 0, size, True, timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
                                        wait_for_workers=False)
            for inbox in self._workers.inboxes:
                inbox.put(self._store.port)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            self._await_workers(joined_key, deadline)
            self.group = init_tensor_parallel_group(0, size, config.device, self._store, parallel.distributed_timeout_s)
            with building_for(self.group):
                model = build_model(config.model, source, hf_config, config.device, max_model_len)
            self.runner = ModelRunner(config, model, hf_config, max_model_len)
            self._store.set(loaded_key(0), "1")
            self._await_workers(loaded_key, deadline)
        except BaseException:
            self._workers.stop(clean=False)
            raise
        self._workers.watch(_weak_callback(self._on_worker_exit))
        logger.info("tensor parallel: %d ranks over %s", size, type(self.group.process_group).__name__)

    # The worker processes (rank r is ``_procs[r - 1]``).
    _procs = property(lambda self: self._workers.procs)

    def _await_workers(self, key_of: Callable[[int], str], deadline: float) -> None:
        """Wait until every worker has set its key, failing as soon as one has exited."""
        keys = [key_of(rank) for rank in range(1, len(self._procs) + 1)]
        while not self._store.check(keys):
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():
                    raise RuntimeError(self._workers.exit_report(rank, "during start-up"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s; "
                                   f"their output is in {self._workers.log_dir}")
            time.sleep(_STARTUP_POLL_S)

    # -- what the engine reads of a runner ----------------------------------------------------

    model = property(lambda self: self.runner.model)
    device = property(lambda self: self.runner.device)
    sampler = property(lambda self: self.runner.sampler)
    block_size = property(lambda self: self.runner.block_size)
    backend = property(lambda self: self.runner.backend)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on one rank (each rank holds its own heads' share)."""
        return self.runner.kv_bytes_per_block()

    def describe_kv_cache(self) -> str:
        """The cache format; its bytes per token are one rank's (each holds its heads' share)."""
        return self.runner.describe_kv_cache()

    def calibrate_kv_scales(self) -> None:
        """Every rank measures its heads' K/V; the ranks store with the largest (the scales of one process)."""
        self._guard(lambda: self.runner.calibrate_kv_scales(self.group.all_reduce_max))

    def profile_num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """The smallest count any rank can hold: block ids mean the same slots on every rank.
        ``extra_bytes_per_block`` is rank 0's alone (a draft model runs in its process)."""
        return self._guard(lambda: self.group.all_reduce_min(self.runner.profile_num_blocks(extra_bytes_per_block)))

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def measure_prefill_tokens_per_s(self, num_tokens: int) -> float:
        """Rank 0's figure of a forward every rank runs (the swap cost model's prefill rate)."""
        return self._call_all("measure_prefill_tokens_per_s", num_tokens)

    def init_swap_space(self, num_blocks: int) -> None:
        """A host pool of ``num_blocks`` on every rank, each for its own heads' share of a block."""
        self._call_all("init_swap_space", num_blocks)

    def swap_blocks(self, out: SchedulerOutput) -> None:
        """A step that only swaps blocks out: every rank copies its share."""
        def step() -> None:
            msg = self._builder.build(out)
            for inbox in self._workers.inboxes:
                inbox.put(msg)
            self.runner.swap_blocks(out)

        self._guard(step)

    def _call_all(self, method: str, *args):
        def call():
            for inbox in self._workers.inboxes:
                inbox.put(RunnerCallMessage(method, args))
            return getattr(self.runner, method)(*args)

        return self._guard(call)

    def call_drafters(self, method: str, *args) -> None:
        """Ask every worker's drafter (its shard of the MTP layer) to run ``method``; rank 0's
        runs it next, so their collectives meet."""
        msg = RunnerCallMessage(method, args, drafter=True)

        def send() -> None:
            self.check_health()
            for inbox in self._workers.inboxes:
                inbox.put(msg)

        self._guard(send)

    def capture_cuda_graphs(self) -> None:
        """Decode graphs would capture collectives; tensor-parallel steps run eagerly."""

    def forget(self, request_id: str) -> None:
        self.runner.forget(request_id)
        self._builder.forget(request_id)

    # -- the step -----------------------------------------------------------------------------

    def launch(self, out: SchedulerOutput) -> PendingSample | None:
        """Queue the step on every rank; rank 0's sampled tokens come back pending, as from a
        ``ModelRunner``. Raises ``EngineDeadError`` once any rank has failed."""
        self.check_health()
        msg = self._builder.build(out)

        def step() -> PendingSample | None:
            for inbox in self._workers.inboxes:
                inbox.put(msg)
            pending = self.runner.launch(out)
            num_sampled = sum(s.samples for s in out.scheduled)
            if num_sampled:  # the workers' test too (runner/worker.py)
                # Every rank reads a pending input token from these (async scheduling); the rows
                # after them are draft positions (speculative decoding), read by rank 0 alone.
                self.group.broadcast_from_first(pending.token_ids[:num_sampled].long())
            return pending

        return self._guard(step)

    def _guard(self, fn):
        try:
            return fn()
        except EngineDeadError:
            raise
        except Exception as e:
            # A failed collective leaves the ranks out of step; no later step can be trusted.
            raise self._fail(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e

    # -- health -------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a rank has failed."""
        if self._dead is not None:
            raise self._dead

    def add_fault_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (on any thread) once, when the executor dies outside a step."""
        self._fault_listeners.append(callback)

    def _on_worker_exit(self, rank: int, exitcode: int | None) -> None:
        self._fail(self._workers.exit_report(rank, "unexpectedly"))

    def _fail(self, reason: str) -> EngineDeadError:
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = EngineDeadError(reason)
        if first:
            logger.error("the tensor-parallel engine is dead: %s (worker output is kept in %s)", reason,
                         self._workers.log_dir)
            self._workers.stop(clean=False)
            for callback in self._fault_listeners:
                try:
                    callback()
                except Exception:
                    logger.exception("fault listener failed")
        return self._dead  # type: ignore[return-value]

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (cleanly if they are healthy); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._workers.stop(clean=self._dead is None)
