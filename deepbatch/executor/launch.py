"""Starting and stopping the tensor-parallel worker processes (ranks 1..N-1).

Start method. ``fork`` where it is safe: a forked worker starts at once and never imports the
main module again, so a plain script needs no ``if __name__ == "__main__":`` guard. It is safe
only while this process runs no thread that could leave the child a lock held forever or torch's
OpenMP pool without its threads (``threads.py``). A process that does (a test runner, a notebook,
a server, a script that ran a large CPU op) starts its workers from ``forkserver`` instead: a
server process of one thread, started once, that has imported the worker's code and forks each
worker from itself. Forking is not safe either once this process holds a CUDA context (a forked
child cannot use it), on macOS (system frameworks are not fork-safe), or where the platform has
no ``fork``. There, and when the program chose ``spawn`` itself
(``multiprocessing.set_start_method("spawn")``), workers are spawned. A spawned worker, and one
the fork server starts, imports the main module again before it runs anything of deepbatch, so a
script that builds the engine at its top level would build it again in every worker. That needs
the guard, and the errors say so.

Output. Each worker's file descriptors 1 and 2 point at ``rank<r>.log`` in a directory made for
this engine under the system temp dir (``TMPDIR``) from the moment the process exists (a worker
from the fork server, which inherits the server's, points them there first thing), so its log
records, tracebacks and whatever native libraries print land there, even output from before
deepbatch's code runs (a spawned worker importing the main module). Errors name the file. A clean
stop removes the directory; when a worker failed it is kept.

Stop. ``stop()`` sends every worker a ``ShutdownMessage`` and joins it, after stopping the watchdog
so an exit that was asked for is never reported as a death. It runs from the executor's
``shutdown``, when the executor is garbage-collected, and at interpreter exit (before
``multiprocessing`` terminates its daemon children).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from multiprocessing import util as mp_util

import torch

from deepbatch.distributed.messages import ShutdownMessage
from deepbatch.executor.threads import fork_is_safe
from deepbatch.executor.watchdog import WorkerWatchdog
from deepbatch.runner.worker import WorkerArgs, WorkerLink, run_worker

logger = logging.getLogger(__name__)

# How long a stop waits for each worker to exit before killing it.
JOIN_S = 5.0
_TAIL_LINES = 20


def choose_start_method() -> str:
    """``fork`` unless it is unsafe here or the program asked for ``spawn``."""
    if multiprocessing.get_start_method(allow_none=True) == "spawn":
        return "spawn"
    if sys.platform == "darwin" or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def worker_start_method() -> str:
    """How to start tensor-parallel workers: as ``choose_start_method``, but from the fork server
    where this process runs threads that make a fork unsafe (``threads.py``)."""
    method = choose_start_method()
    if method == "fork" and not fork_is_safe() and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return method


def _preload_fork_server(ctx, args: WorkerArgs) -> None:
    """Have the fork server import the worker's code and the model config's class once, so each
    worker it forks starts at once instead of importing torch and transformers again (the
    config's module alone pulls in some 1,700 modules: 2 s on two cores). Only a server not yet
    running can be told (and only ours to tell: a program that set its own preload list keeps it)."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is None and getattr(server, "_preload_modules", None) == ["__main__"]:
        ctx.set_forkserver_preload(["deepbatch.runner.worker", type(args.hf_config).__module__])


def guard_hint(method: str | None = None) -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    where = f" ({main})" if main else ""
    how = f"with the {method!r} start method" if method else "spawned or started by the fork server,"
    return (f"{how} each worker first imports the main module{where} again, so a "
            f"script must create the LLM (or engine) under `if __name__ == \"__main__\":`, not at its top level")


def check_not_importing_main() -> None:
    """Refuse to start an engine from the top level of a main module that a spawned process is
    importing again: that is a worker's start-up running the user's script, which would start
    workers of its own."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise RuntimeError(f"a tensor-parallel engine was started while a worker process imported the "
                               f"main module: {guard_hint()}")
        frame = frame.f_back


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Point this process's fds 1 and 2 at ``path`` while a child starts (it inherits them),
    then back. Output other threads write meanwhile lands in the file too; the window is the
    child's creation only."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved: dict[int, int | None] = {}
    for target in (1, 2):
        try:
            saved[target] = _dup_above_stdio(target)
        except OSError:  # closed (a daemon without stdio): closed again afterwards
            saved[target] = None
    raw = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    fd = _dup_above_stdio(raw)
    os.close(raw)
    try:
        for target in saved:
            os.dup2(fd, target)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, old in saved.items():
            if old is None:
                os.close(target)
            else:
                os.dup2(old, target)
                os.close(old)
        os.close(fd)


def _dup_above_stdio(fd: int) -> int:
    # Never 0-2, even when one of them is closed: those are the numbers being swapped.
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)


class WorkerGroup:
    """The worker processes of one engine: ``procs[i]`` and ``inboxes[i]`` are rank ``i + 1``'s.

    ``stop()`` is idempotent and may run on any thread, from a finalizer or at interpreter exit;
    it holds nothing of the executor, so the executor can be collected while its workers run."""

    def __init__(self, world_size: int, args_of: Callable[[int], WorkerArgs]):
        self.method = worker_start_method()
        ctx = multiprocessing.get_context(self.method)
        if self.method == "forkserver":
            _preload_fork_server(ctx, args_of(1))
        self.log_dir = tempfile.mkdtemp(prefix=f"deepbatch-tp-{os.getpid()}-")
        logger.info("tensor parallel: starting %d worker process(es) by %s; their output goes to %s",
                    world_size - 1, self.method, self.log_dir)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.inboxes: list = []
        self._started: list = []  # set by each worker once deepbatch's code runs in it
        self._alive_pipes: list = []  # forkserver: each worker sees its end close when rank 0 exits
        self._watchdog: WorkerWatchdog | None = None
        self._lock = threading.Lock()
        self._stopped = False
        try:
            for rank in range(1, world_size):
                inbox = ctx.Queue()
                # Never wait at exit for messages a dead worker will not read.
                inbox.cancel_join_thread()
                started = ctx.Event()
                link = WorkerLink(inbox, started)
                if self.method == "forkserver":
                    # The server's child inherits the server's fds and environment and knows the
                    # server as its parent: it opens its log itself, takes this process's
                    # environment, and watches rank 0 through a pipe only rank 0 holds.
                    alive_r, alive_w = ctx.Pipe(duplex=False)
                    self._alive_pipes.append(alive_w)
                    link = WorkerLink(inbox, started, self.log_path(rank), dict(os.environ), alive_r)
                proc = ctx.Process(target=run_worker, args=(args_of(rank), link),
                                   name=f"deepbatch-tp{rank}", daemon=True)
                with _output_to(self.log_path(rank)):
                    proc.start()
                if link.rank0_alive is not None:
                    link.rank0_alive.close()
                self.inboxes.append(inbox)
                self._started.append(started)
                self.procs.append(proc)
        except BaseException:
            self.stop(clean=False)
            raise
        # At interpreter exit multiprocessing runs its finalizers, then terminates daemon children.
        # Ranked above its queues' own finalizers (10), this one still has working queues to send
        # the shutdown on, whatever the order of atexit hooks.
        self._at_exit = mp_util.Finalize(None, self.stop, exitpriority=100)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank{rank}.log")

    def watch(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Report (once) a worker that exits before ``stop()``."""
        self._watchdog = WorkerWatchdog(self.procs, on_exit)

    def exit_report(self, rank: int, during: str) -> str:
        """Why rank ``rank``, which has exited, is gone, and where its output is; its last lines
        go to this process's log, which outlives a temp dir in a container."""
        proc = self.procs[rank - 1]
        proc.join(0)
        path = self.log_path(rank)
        self._log_tail(rank)
        if self.method != "fork" and not self._started[rank - 1].is_set():
            return (f"tensor-parallel worker rank {rank} exited {during} (exit code {proc.exitcode}) before it "
                    f"reached deepbatch's worker code: {guard_hint(self.method)}. Its output is in {path}")
        return (f"tensor-parallel worker rank {rank} exited {during} (exit code {proc.exitcode}); "
                f"its output is in {path}")

    def _log_tail(self, rank: int) -> None:
        try:
            with open(self.log_path(rank), errors="replace") as f:
                lines = f.readlines()[-_TAIL_LINES:]
        except OSError:
            return
        if lines:
            logger.error("last lines of tensor-parallel worker rank %d's output:\n%s", rank, "".join(lines).rstrip())

    def stop(self, clean: bool = True) -> None:
        """End the workers: with ``clean``, ask them to exit and wait; kill whoever is left."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        at_exit = getattr(self, "_at_exit", None)
        if at_exit is not None:
            at_exit.cancel()
        if self._watchdog is not None:
            self._watchdog.stop()
        if clean:
            for inbox in self.inboxes:
                inbox.put(ShutdownMessage())
            for proc in self.procs:
                proc.join(JOIN_S)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(JOIN_S)
        for inbox in self.inboxes:
            inbox.close()
        for pipe in self._alive_pipes:
            pipe.close()
        if self.procs and all(p.exitcode == 0 for p in self.procs):
            shutil.rmtree(self.log_dir, ignore_errors=True)
