"""Every environment variable deepbatch reads, in one place.

Values are read when accessed (``envs.DEEPBATCH_FAULT_INJECT_STEP``), not at import, so a test
that sets a variable before starting a server sees it. The edge (CLI, server) reads them and
passes plain values down; nothing below the edge imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# NVLink multicast (NVLS) collectives have hung all-reduces on some drivers; off unless the
# operator turns it on. Set here, at import, so every process NCCL starts in inherits it.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _int_or_none(name: str) -> Callable[[], int | None]:
    def read() -> int | None:
        raw = os.environ.get(name, "").strip()
        return int(raw) if raw else None

    return read


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name, "").strip()
        return float(raw) if raw else default

    return read


def _int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name, "").strip()
        return int(raw) if raw else default

    return read


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Testing only: the engine thread raises at its N-th model step (1-based), to exercise the
    # dead-engine path end to end. Unset in production.
    "DEEPBATCH_FAULT_INJECT_STEP": _int_or_none("DEEPBATCH_FAULT_INJECT_STEP"),
    # Testing only: a tensor-parallel worker misbehaves at its N-th model step (1-based) in the
    # way DEEPBATCH_FAULT_INJECT_WORKER_MODE says, to exercise the watchdog. Unset in production.
    "DEEPBATCH_FAULT_INJECT_WORKER_STEP": _int_or_none("DEEPBATCH_FAULT_INJECT_WORKER_STEP"),
    # "stall" (the worker sleeps instead of running the step) or "raise" (it fails the step).
    "DEEPBATCH_FAULT_INJECT_WORKER_MODE": lambda: os.environ.get("DEEPBATCH_FAULT_INJECT_WORKER_MODE", "stall"),
    # Testing only: the sampler raises for the request with this id (the server's ids are
    # "cmpl-<X-Request-Id>"), to exercise request-scoped faults. Unset in production.
    "DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST": lambda: os.environ.get("DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST") or None,
    # Testing only: detokenization raises for the request with this id (in the API process when the
    # engine core runs in its own), to exercise request-scoped faults there. Unset in production.
    "DEEPBATCH_FAULT_INJECT_DETOKENIZE_REQUEST":
        lambda: os.environ.get("DEEPBATCH_FAULT_INJECT_DETOKENIZE_REQUEST") or None,
    # The server's API key when --api-key is not given (keeps it out of the process list).
    "DEEPBATCH_API_KEY": lambda: os.environ.get("DEEPBATCH_API_KEY") or None,
    # Seconds between the server's throughput/occupancy log lines; 0 turns them off.
    "DEEPBATCH_LOG_STATS_INTERVAL": _float("DEEPBATCH_LOG_STATS_INTERVAL", 10.0),
    # Largest accepted HTTP request body in bytes (larger bodies get 413 before parsing).
    "DEEPBATCH_MAX_REQUEST_BODY_BYTES": _int("DEEPBATCH_MAX_REQUEST_BODY_BYTES", 4 << 20),
    # Where the config and tokenizer converted from GGUF files are cached ("" turns it off).
    "DEEPBATCH_CACHE_DIR": lambda: os.environ.get(
        "DEEPBATCH_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "deepbatch")
    ) or None,
    # Threads that tokenize prompts and apply chat templates beside the event loop.
    "DEEPBATCH_TOKENIZER_THREADS": _int("DEEPBATCH_TOKENIZER_THREADS", 2),
    # 1 (the default): ``deepbatch serve`` runs the engine core in a process of its own beside
    # the API process; 0: it steps the engine on a thread of the API process (for debugging).
    "DEEPBATCH_ENGINE_PROCESS": _int("DEEPBATCH_ENGINE_PROCESS", 1),
    # 1: the offline ``LLM`` runs the engine core in a process of its own and makes the text in
    # the calling process (``engine/offline_client.py``); 0 (the default): it steps the engine in
    # the calling process, where ``LLM.engine`` reaches every part of it.
    "DEEPBATCH_LLM_ENGINE_PROCESS": _int("DEEPBATCH_LLM_ENGINE_PROCESS", 0),
}


def __getattr__(name: str) -> Any:
    try:
        return _VARIABLES[name]()
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return list(_VARIABLES)
