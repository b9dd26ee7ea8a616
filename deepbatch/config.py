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
    # A weight format applied while loading a 16-bit checkpoint ("fp8"), or the checkpoint's own
    # quant_method named explicitly; None: whatever config.json's quantization_config says.
    quantization: str | None = None


# How the paged KV cache stores K and V (vLLM's names plus int8; deepbatch/kernels/kv_quant.py):
# auto = the model dtype; fp8 = fp8_e4m3 and fp8_e5m2 with per-layer scales from the checkpoint
# (else 1.0); int8 with a scale per token and KV head computed as it is written.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Fixes the number of KV blocks instead of profiling memory (tests, reproducible runs).
    num_gpu_blocks_override: int | None = None
    # KV budget on the CPU, where there is no device memory to profile.
    cpu_kv_cache_bytes: int = 2 << 30
    # Host memory (GiB) for preemption by swap (vLLM's --swap-space); 0: recompute only.
    swap_space: float = 0.0
    # Rates of the swap-or-recompute cost model; None: measured at start-up.
    swap_prefill_tokens_per_s: float | None = None
    swap_host_link_bytes_per_s: float | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override: must be >= 1")
        if self.swap_space < 0:
            raise ValueError(f"swap_space: must be >= 0 GiB, got {self.swap_space}")
        for name in ("swap_prefill_tokens_per_s", "swap_host_link_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name}: must be > 0, got {v}")


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
    # p99 latency targets of the SLO controller (control/controller.py); either one turns it on.
    # It moves max_num_seqs and max_num_batched_tokens at run time, never above the values above.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Admission batching: while requests are decoding, admit waiting ones only once
    # min(admission_batch_size, waiting) seats are free, or a seat has been free this long. A step
    # that carries a prefill runs without CUDA graphs and costs several decode steps of host
    # time, so admitting one request per freed seat keeps the GPU waiting; grouping them trades a
    # bounded delay to the first token for throughput. 1 admits at once.
    admission_batch_size: int = 1
    admission_max_delay_ms: float = 250.0
    # How a victim gives up its KV blocks: "auto" (the swap cost model decides, per victim),
    # "swap" (whenever the host pool can take it), "recompute". Swap needs a swap space.
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority", "fair"):
            raise ValueError(f"policy: must be 'fcfs', 'priority' or 'fair', got {self.policy!r}")
        if self.admission not in ("greedy", "predictive"):
            raise ValueError(f"admission: must be 'greedy' or 'predictive', got {self.admission!r}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode: must be auto, swap or recompute, got {self.preemption_mode!r}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark: must be in [0, 1), got {self.kv_watermark}")
        if self.admission_batch_size < 1:
            raise ValueError(f"admission_batch_size: must be >= 1, got {self.admission_batch_size}")
        if self.admission_max_delay_ms < 0:
            raise ValueError(f"admission_max_delay_ms: must be >= 0, got {self.admission_max_delay_ms}")
        if self.priority_aging_s < 0:
            raise ValueError(f"priority_aging_s: must be >= 0, got {self.priority_aging_s}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: must be > 0, got {v}")
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
    # "full": CUDA graphs for every step, prefill chunks included; "decode": decode-only steps.
    cuda_graph_mode: str = "full"
    # How MLA models (DeepSeek-V2/V3) attend in prefill chunks: "expanded" (the chunk's own keys
    # and values decompressed by kv_b_proj, 3.4x fewer FLOPs per key; cached context stays in the
    # latent space) or "absorbed" (everything in the latent space, as decodes do).
    mla_prefill: str = "expanded"
    # Temperature-only batches on a GPU sampled by one Triton pass over the logits
    # (kernels/sample.py) instead of several torch passes; False keeps the torch ops.
    fused_sampler: bool = True
    # Schedule step N+1 while step N runs on the device (None: on for CUDA devices).
    async_scheduling: bool | None = None
    log_stats: bool = False
    parallel: ParallelConfig = ParallelConfig()
    # Testing only: the sampler raises for the request (or parent request) with this id, to show
    # that a fault inside one request's sampling ends that request alone. None in production.
    fault_inject_sample_request: str | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: must be auto, torch or triton, got {self.attention_backend!r}")
        if self.cuda_graph_mode not in ("full", "decode"):
            raise ValueError(f"cuda_graph_mode: must be full or decode, got {self.cuda_graph_mode!r}")
        if self.mla_prefill not in ("absorbed", "expanded"):
            raise ValueError(f"mla_prefill: must be absorbed or expanded, got {self.mla_prefill!r}")
        if self.scheduler.preemption_mode == "swap" and self.cache.swap_space <= 0:
            raise ValueError("preemption_mode: 'swap' needs a swap space (swap_space > 0 GiB)")
        if self.parallel.tensor_parallel_size > 1:
            # Workers learn each step's input ids from rank 0's message, so a token still on
            # rank 0's device (async scheduling) or KV blocks on the host (swap) cannot reach them.
            if self.async_scheduling:
                raise ValueError("async_scheduling: not supported with tensor_parallel_size > 1")
            if self.cache.swap_space > 0:
                raise ValueError("swap_space: not supported with tensor_parallel_size > 1 (preemption recomputes)")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
