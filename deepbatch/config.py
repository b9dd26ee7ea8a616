"""Frozen configuration, built once at the edge (CLI, HTTP server, ``LLM(...)``) and passed down.

Values discovered at start-up (the number of KV blocks after memory profiling) are returned by
the component that finds them, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """``auto`` means bf16 on a GPU and fp32 on the CPU (where bf16 matmuls are slow and fp32 is the
    reference precision)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    model: str | None  # None means the embedded default (SmolLM2-135M-Instruct, GGUF)
    dtype: torch.dtype
    max_model_len: int | None  # None: the model's own context length
    seed: int = 0
    random_weights: bool = False  # build from config.json with seeded random weights (benchmarks)
    tokenizer: str | None = None
    # Where the config and tokenizer converted from a GGUF file are cached (None: no cache).
    cache_dir: str | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Fixes the number of KV blocks instead of profiling memory (tests, reproducible runs).
    num_gpu_blocks_override: int | None = None
    # KV budget on the CPU, where there is no device memory to profile.
    cpu_kv_cache_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override: must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    policy: str = "fcfs"  # "fcfs" | "priority" | "fair" (per-tenant fair share)
    # Priority policy: a waiting request's priority improves by one every this many seconds.
    priority_aging_s: float = 30.0
    # Per-tenant limits (None: unlimited).
    tenant_max_running: int | None = None
    tenant_max_tokens_per_minute: int | None = None
    # Static batching (only to reproduce static-vs-continuous comparisons): admit a new batch of
    # at most this many requests only once the previous batch has fully finished.
    static_batch_size: int | None = None
    # "greedy": admit whenever the prompt's blocks are free. "predictive": admit only when the
    # prompt plus the expected rest of its output, plus the expected growth of running requests
    # and a watermark, fit the free blocks, so running requests are rarely preempted.
    admission: str = "greedy"
    kv_watermark: float = 0.01  # fraction of all blocks kept free at admission

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"policy: must be 'fcfs', 'priority' or 'fair', got {self.policy!r}")
        if self.admission not in ("greedy", "predictive"):
            raise ValueError(f"admission: must be 'greedy' or 'predictive', got {self.admission!r}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark: must be in [0, 1), got {self.kv_watermark}")
        if self.priority_aging_s < 0:
            raise ValueError(f"priority_aging_s: must be >= 0, got {self.priority_aging_s}")
        for name in ("tenant_max_running", "tenant_max_tokens_per_minute", "static_batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}: must be >= 1, got {v}")


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks the model is sharded over (one process each; rank 0 also runs the scheduler).
    tensor_parallel_size: int = 1
    # Longest any collective, or a worker's part of a step, may take before the engine is
    # declared dead instead of hanging.
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s: must be > 0, got {self.distributed_timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    enforce_eager: bool = False
    log_stats: bool = False
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: must be auto, torch or triton, got {self.attention_backend!r}")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
