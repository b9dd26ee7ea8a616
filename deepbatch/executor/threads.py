"""Whether this process may be forked safely, judged by the threads it runs (``launch``).

A fork copies every lock as it is but only the thread that forks. Native threads that exist as
soon as torch is imported (a BLAS library's pool, parked, with fork handlers of its own) are
harmless; any thread started since is not known to be: a Python thread may hold a lock the child
needs (tqdm's, a handler's), and torch's OpenMP pool, which the first large CPU op starts, is
copied without its threads, so a child's first parallel region waits for them forever. The
baseline is taken when this module is first imported, which ``deepbatch.llm`` does beside its
import of torch: a program that ran torch ops before importing deepbatch is judged from there.
"""

from __future__ import annotations

import os
import threading

import torch  # noqa: F401 - the baseline counts the threads its import starts


def os_thread_count() -> int:
    """This process's threads, native ones included: Python's ``threading`` sees only its own."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: what Python knows of
        return threading.active_count()


_NATIVE_AT_IMPORT = os_thread_count() - threading.active_count()


def fork_is_safe() -> bool:
    """No Python thread but this one, and no native thread started since torch was imported."""
    return threading.active_count() == 1 and os_thread_count() - 1 <= _NATIVE_AT_IMPORT
