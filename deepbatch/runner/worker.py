"""A tensor-parallel worker: one process per rank >= 1, holding its shard of the model and of
the KV cache, running the same forward as rank 0 on the batch each ``StepMessage`` describes.

Start-up runs in lockstep with rank 0 (``TensorParallelExecutor``), collective for collective:
take the store's port (the first message), join the group, build the model shard, profile the KV
cache, agree on the smallest block count. Then the loop: wait for a message, mirror it, run the
forward, take rank 0's sampled ids. The worker exits 0 on ``ShutdownMessage`` or when rank 0's
process is gone, and 1 on any error (which rank 0 sees as a failed collective or through its
watchdog).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any
from datetime import timedelta

import torch

from deepbatch import envs
from deepbatch.config import EngineConfig
from deepbatch.distributed.messages import (DRAFTER_CALLS, RUNNER_CALLS, RequestMirror, RunnerCallMessage,
                                            ShutdownMessage, StepMessage)
import torch.distributed as dist

from deepbatch.distributed.parallel_state import (STARTUP_TIMEOUT_S, building_for, init_tensor_parallel_group,
                                                  joined_key, loaded_key)
from deepbatch.models.loader import ModelSource, build_model
from deepbatch.runner.mtp_runner import MTPRunner
from deepbatch.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How often an idle worker checks that rank 0's process still exists.
_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    store_host: str  # the port comes as the first message: rank 0 opens its store after the fork
    config: EngineConfig
    source: ModelSource
    hf_config: object
    max_model_len: int


@dataclass
class WorkerLink:
    """What ties a worker to rank 0: ``inbox``, the queue rank 0 puts messages on; ``started``, an
    event set once this code runs. A worker the fork server starts also gets its ``log_path``
    (its fds 1 and 2 are the server's), rank 0's ``environ`` (it has the server's, as it was when
    the server started) and ``rank0_alive``, a pipe end that reads as closed once rank 0 exits (its
    parent is the server, not rank 0)."""
    inbox: Any
    started: Any = None
    log_path: str | None = None
    environ: dict[str, str] | None = None
    rank0_alive: Any = None


class _PipeWatch:
    def __init__(self, conn):
        self._conn = conn

    def is_alive(self) -> bool:
        return not self._conn.poll()  # rank 0 never writes: readable means its end closed


def run_worker(args: WorkerArgs, link: WorkerLink) -> None:
    """Process entry point (forked, spawned or from the fork server, ``launch`` decides). Stdout
    and stderr are the rank's log file."""
    if link.environ is not None:
        os.environ.clear()
        os.environ.update(link.environ)
    if link.log_path is not None:
        fd = os.open(link.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    # Ctrl-C reaches the whole process group; rank 0 handles it and stops the workers cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked worker inherits rank 0's Python-level streams, which need not be fds 1 and 2 (a test
    # runner's capture, a notebook's socket); write to the fds, which are this rank's log file.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # It inherits rank 0's logging set-up too; its records go to its own log instead.
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [tp-rank{args.rank}] %(message)s",
                        stream=sys.stderr, force=True)
    if link.started is not None:
        link.started.set()
    logger.info("tensor-parallel worker rank %d of %d: pid %d, parent %d", args.rank, args.world_size, os.getpid(),
                os.getppid())
    # The entry point is this process's edge: the one place it reads the environment.
    fault = (envs.DEEPBATCH_FAULT_INJECT_WORKER_STEP, envs.DEEPBATCH_FAULT_INJECT_WORKER_MODE)
    try:
        rank0 = _PipeWatch(link.rank0_alive) if link.rank0_alive is not None else multiprocessing.parent_process()
        _serve(args, link.inbox, rank0, fault)
    except BaseException:  # noqa: BLE001 - whatever it is, rank 0 must learn of it by our exit
        logger.exception("tensor-parallel worker rank %d failed", args.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a broken process group can block it
    os._exit(0)


def _serve(args: WorkerArgs, inbox, rank0, fault: tuple[int | None, str]) -> None:
    config = args.config
    if config.device.startswith("cuda"):
        torch.cuda.set_device(args.rank)
    else:
        # The ranks share the host's cores; each one using all of them only makes them contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    torch.manual_seed(config.model.seed)
    parallel = config.parallel
    port = _next_message(inbox, rank0)  # rank 0's store: opened once its workers exist
    if not isinstance(port, int):  # rank 0 is gone, or stopped before it started
        return
    # The store lives in rank 0's process: if rank 0 goes away, waiting on it fails at once.
    store = dist.TCPStore(args.store_host, port, args.world_size, False,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(joined_key(args.rank), "1")
    group = init_tensor_parallel_group(args.rank, args.world_size, config.device, store, parallel.distributed_timeout_s)
    with building_for(group):
        model = build_model(config.model, args.source, args.hf_config, config.device, args.max_model_len)
    store.set(loaded_key(args.rank), "1")
    store.wait([loaded_key(0)])  # the first collective follows: start it once rank 0 is ready too
    runner = ModelRunner(config, model, args.hf_config, args.max_model_len)
    runner.calibrate_kv_scales(group.all_reduce_max)  # where rank 0's engine calls it: before profiling
    num_blocks = group.all_reduce_min(runner.profile_num_blocks())
    runner.init_kv_cache(num_blocks)
    drafter = None
    spec = config.speculative_config
    if spec is not None and spec.method == "mtp":  # this rank's shard of the MTP layer, as rank 0 builds it
        drafter = MTPRunner(config, runner, args.max_model_len)
        drafter.init_kv_cache(num_blocks)
    mirror = RequestMirror()
    while True:
        msg = _next_message(inbox, rank0)
        if msg is None or isinstance(msg, ShutdownMessage):
            return
        if isinstance(msg, RunnerCallMessage) and msg.method in (DRAFTER_CALLS if msg.drafter else RUNNER_CALLS):
            getattr(drafter if msg.drafter else runner, msg.method)(*msg.args)
            continue
        if not isinstance(msg, StepMessage):
            raise TypeError(f"unexpected message {type(msg).__name__}")
        if msg.step == fault[0]:
            _inject_fault(args.rank, fault[1])
        for req_id in msg.finished_req_ids:
            runner.forget(req_id)  # its row in the token pool
        out = mirror.apply(msg)
        if not out.scheduled:  # a step that only swaps blocks out
            runner.swap_blocks(out)
            continue
        runner.launch(out)
        sampled = [s.request for s in out.scheduled if s.samples]
        if sampled:
            # Rank 0's sampled ids: where a pending input token of the next step is read.
            token_ids = torch.empty(len(sampled), dtype=torch.long, device=runner.device)
            runner.adopt_sampled(group.broadcast_from_first(token_ids))


def _next_message(inbox, rank0):
    """The next message, or None once rank 0's process is gone (nobody will send one)."""
    while True:
        try:
            return inbox.get(timeout=_PARENT_POLL_S)
        except queue.Empty:
            if rank0 is not None and not rank0.is_alive():
                return None


def _inject_fault(rank: int, mode: str) -> None:
    """Testing only: fail the step, or stall it past any timeout."""
    if mode == "raise":
        raise RuntimeError(f"injected fault in tensor-parallel worker rank {rank}")
    logger.warning("injected stall in tensor-parallel worker rank %d", rank)
    time.sleep(3600)
