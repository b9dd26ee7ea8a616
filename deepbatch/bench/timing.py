"""Timing one GPU launch sequence for the kernel sweeps in ``benchmarks/``, and giving an
engine's GPU memory back between the runs of one benchmark."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def device_time_us(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Mean microseconds per call of ``fn`` between CUDA events, after ``warmup`` calls (Triton
    compiles and cuBLAS picks its kernels there). Without a GPU (a smoke run under
    ``TRITON_INTERPRET=1``) one call's wall time."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def release_gpu_memory() -> None:
    """After the caller dropped its last reference to an engine: give its GPU memory back, so
    that the next engine (or a peer) sizes its KV pool on what is really free."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
