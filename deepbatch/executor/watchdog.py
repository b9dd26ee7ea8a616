"""Watches the worker processes from rank 0 and reports the first one that exits unasked.

Collectives already bound every step (``communication``): a worker that stalls makes rank 0's
next collective time out, and one that dies makes it fail at once. The watchdog covers the time
between steps: a worker that dies while the engine is idle is reported now, so the server turns
unhealthy before the next request arrives instead of failing that request.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)


class WorkerWatchdog:
    def __init__(self, procs: Sequence[BaseProcess], on_exit: Callable[[int, int | None], None]):
        """``procs[i]`` is rank ``i + 1``; ``on_exit(rank, exitcode)`` runs on the watchdog's
        thread at most once, for the first worker that exits before ``stop()``."""
        self._procs = list(procs)
        self._on_exit = on_exit
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="deepbatch-tp-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        ready = mpc.wait([*sentinels, self._stop_r])  # blocks without polling
        if self._stopped or self._stop_r in ready:
            return
        rank = sentinels[ready[0]]
        proc = self._procs[rank - 1]
        proc.join(0)
        logger.error("tensor-parallel worker rank %d exited (code %s)", rank, proc.exitcode)
        self._on_exit(rank, proc.exitcode)

    def stop(self) -> None:
        """Stop watching (before a shutdown that ends the workers on purpose)."""
        if self._stopped:
            return
        self._stopped = True
        # From its own report (the dead engine ends the workers) the wait is already over.
        if threading.current_thread() is not self._thread:
            os.write(self._stop_w, b"x")
            self._thread.join(5.0)
        os.close(self._stop_r)
        os.close(self._stop_w)
