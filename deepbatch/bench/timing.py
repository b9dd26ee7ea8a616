"""Timing one GPU launch sequence for the kernel sweeps in ``benchmarks/``."""

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
