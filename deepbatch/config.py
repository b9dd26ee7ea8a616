"""Frozen configuration, built once at the edge (CLI, HTTP server, ``LLM(...)``) and passed down.

Values discovered at start-up (the number of KV blocks after memory profiling) are returned by
the component that finds them, never written back here.

Every field is either an engine argument, declared with ``arg(...)`` (its help text, choices and
spelling), or marked ``internal(...)``: ``deepbatch/engine_args.py`` generates the CLI flags and
the ``LLM(...)`` keywords from these declarations, so a field is described here and nowhere else.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

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


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # an ArgSpec default not given (None is a value: "resolve at build time")


@dataclass(frozen=True)
class ArgSpec:
    """How a config field is offered to users: ``LLM(name=...)`` and ``--name`` (dashes)."""

    help: str
    choices: tuple[str, ...] | None = None
    # vLLM's spelling when it differs from the field's (``scheduling_policy`` for ``policy``).
    name: str | None = None
    aliases: tuple[str, ...] = ()  # more CLI spellings (``-tp``)
    # The default users see when the field has none, or when the edge resolves it at build time
    # (``device=None``: cuda when available); UNSET: the field's own default.
    user_default: Any = UNSET
    cli_default: Any = UNSET  # where the CLI's default differs from LLM(...)'s
    type: Any = None  # what users pass when it differs from the stored type (dtype: a name)
    internal: bool = False  # set by the edge or by tests, never offered to users
    env: str | None = None  # internal: read from this deepbatch.envs variable at build time


def arg(default: Any = MISSING, help: str = "", **spec: Any) -> Any:
    """A field that is an engine argument (``ArgSpec`` names the rest); MISSING: a required field."""
    meta = {"arg": ArgSpec(help, **spec)}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


def internal(default: Any, why: str, env: str | None = None) -> Any:
    """A field that is not an engine argument: derived, for tests, or read from ``env``."""
    return field(default=default, metadata={"arg": ArgSpec(why, internal=True, env=env)})


def _check_choices(config: Any) -> None:
    """Each field with choices holds one of them, and each switch a bool (None too where the field
    may be None): ``"no"`` or ``0`` would otherwise pass as a truth value."""
    for f in fields(config):
        spec = f.metadata.get("arg")
        if spec is None:
            continue
        value = getattr(config, f.name)
        types = str(f.type).replace(" ", "").split("|")
        if value is None and "None" in types:
            continue
        if "bool" in types and not isinstance(value, bool):
            raise ValueError(f"{spec.name or f.name}: must be true or false; got {value!r}")
        if spec.choices is not None and value not in spec.choices:
            raise ValueError(f"{spec.name or f.name}: must be one of {', '.join(spec.choices)}; got {value!r}")


# Weight formats --quantization names (deepbatch/layers/quantization); fp8 is also applied online.
QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = arg(help="a .gguf file, an HF model directory, or a bare config.json (random weights); "
                                 "default: the embedded SmolLM2-135M-Instruct", user_default=None)
    dtype: torch.dtype = arg(help="auto (bf16 on GPU, fp32 on CPU), float32, float16, bfloat16 (also fp32, fp16, "
                                  "half, bf16; LLM(...) also takes a torch.dtype)", user_default="auto", type=str)
    max_model_len: int | None = arg(help="context length (default: the model's)", user_default=None)
    seed: int = arg(0, "seed of torch's generator at start-up and of random weights")
    random_weights: bool = arg(False, "build the model with seeded random weights instead of loading them "
                                      "(benchmarks; a bare config.json always does)")
    tokenizer: str | None = arg(None, "tokenizer directory (default: the model's)")
    cache_dir: str | None = internal(None, "where the config, tokenizer and dequantized weights of a GGUF file are "
                                           "cached (None: no cache)", env="DEEPBATCH_CACHE_DIR")
    quantization: str | None = arg(
        None, "weight format: fp8 quantizes a 16-bit checkpoint to FP8 per channel while loading; a quantized "
              "checkpoint's format is read from its config.json (naming it here only checks it)",
        choices=QUANTIZATION_METHODS)
    # Fixed when the model is built. "expanded" is 3.4x fewer FLOPs per key than "absorbed" on DeepSeek-V2-Lite.
    mla_prefill: str = arg("expanded", "MLA models, prefill chunks: attend over their new tokens' keys and values "
                                       "decompressed by kv_b_proj (expanded; 3.4x fewer FLOPs) or in the latent space "
                                       "(absorbed); cached context is attended in the latent space either way",
                           choices=("absorbed", "expanded"))

    def __post_init__(self) -> None:
        _check_choices(self)


# How the paged KV cache stores K and V (vLLM's names plus int8; deepbatch/kernels/kv_quant.py):
# auto = the model dtype; fp8 = fp8_e4m3 and fp8_e5m2 with per-layer scales from the checkpoint
# (else measured at start-up with calculate_kv_scales, else 1.0); int8 with a scale per token and
# KV head computed as it is written.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = arg(16, "tokens per KV cache block (a power of two)")
    gpu_memory_utilization: float = arg(0.9, "fraction of GPU memory for weights, activations and the KV cache")
    enable_prefix_caching: bool = arg(True, "reuse the KV cache of shared prompt prefixes")
    num_gpu_blocks_override: int | None = arg(None, "fix the number of KV blocks instead of profiling memory")
    cpu_kv_cache_bytes: int = internal(2 << 30, "KV budget on the CPU, where there is no device memory to profile")
    swap_space: float = arg(0.0, "host memory (GiB) for preempting by swapping KV blocks out, per rank under "
                                   "tensor parallelism; 0: recompute only")
    # Rates of the swap-or-recompute cost model.
    swap_prefill_tokens_per_s: float | None = arg(
        None, "prefill rate the swap-or-recompute choice assumes (default: measured at start-up)")
    swap_host_link_bytes_per_s: float | None = arg(
        None, "host-link rate the swap-or-recompute choice assumes (default: measured at start-up)")
    kv_cache_dtype: str = arg("auto", "KV cache storage: auto (the model dtype); fp8 (= fp8_e4m3) or fp8_e5m2 with "
                                      "the checkpoint's per-layer k_scale/v_scale (else 1.0); int8 with a scale per "
                                      "token and KV head", choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = arg(False, "fp8 KV cache: give each attention layer whose checkpoint has no "
                                           "k_scale/v_scale scales measured at start-up on one forward over random "
                                           "tokens, instead of 1.0, which saturates K/V past the format's range "
                                           "(other formats have no per-layer scales and ignore it)")

    def __post_init__(self) -> None:
        _check_choices(self)
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
    max_num_seqs: int = arg(256, "most sequences in one step")
    max_num_batched_tokens: int = arg(8192, "token budget of one step")
    policy: str = arg("fcfs", "fcfs; priority (the request's priority, lower first, with aging); or fair "
                              "(per-tenant fair share; the tenant is the request's 'user')",
                      name="scheduling_policy", choices=("fcfs", "priority", "fair"))
    priority_aging_s: float = arg(30.0, "priority policy: a waiting request gains one priority level per this "
                                        "many seconds")
    tenant_max_running: int | None = arg(None, "most running requests per tenant (default: no limit)")
    tenant_max_tokens_per_minute: int | None = arg(None, "scheduled tokens per tenant per minute (default: no limit)")
    # Admits a new batch only once the previous batch has fully finished.
    static_batch_size: int | None = arg(
        None, "static batching, only to compare against continuous batching: fixed batches of at most this many "
              "requests (None: continuous); on the command line --scheduling static [--static-batch-size N]",
        cli_default=8)
    # "predictive" counts the prompt plus the expected rest of its output, plus the expected growth
    # of running requests and the watermark, against the free blocks.
    admission: str = arg("greedy", "greedy: admit whenever the prompt's blocks are free; predictive: only when the "
                                   "expected output also fits, so running requests are rarely preempted",
                         choices=("greedy", "predictive"))
    kv_watermark: float = arg(0.01, "fraction of KV blocks kept free at admission")
    # The SLO controller (control/controller.py) moves max_num_seqs and max_num_batched_tokens at
    # run time, never above the values above.
    slo_ttft_ms: float | None = arg(None, "p99 time-to-first-token target; turns on the SLO controller, which tunes "
                                          "max_num_seqs and max_num_batched_tokens (as upper limits) online")
    slo_tpot_ms: float | None = arg(None, "p99 time-per-output-token target of the SLO controller")
    # A step that carries a prefill runs without CUDA graphs and costs several decode steps of
    # host time, so admitting one request per freed seat keeps the GPU waiting; grouping them
    # trades a bounded delay to the first token for throughput.
    admission_batch_size: int = arg(
        1, "while requests decode, admit waiting ones only once this many seats are free (or one has been free "
           "admission_max_delay_ms); 1 admits at once. Default: 1 on the command line; LLM(...) and "
           "bench throughput: 64 on CUDA with graphs, else 1", user_default=None, cli_default=1)
    admission_max_delay_ms: float = arg(250.0, "longest a free seat waits for its admission group")
    preemption_mode: str = arg("auto", "how a preempted request gives up its KV blocks: auto (swap or recompute, "
                                       "whichever the cost model says is cheaper), swap (needs swap_space), recompute",
                               choices=("auto", "swap", "recompute"))

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
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
    # One process per rank; rank 0 also runs the scheduler.
    tensor_parallel_size: int = arg(1, "shard the model over this many ranks (GPUs, or CPU processes over gloo)",
                                    aliases=("-tp",))
    distributed_timeout_s: float = arg(60.0, "tensor parallel: longest a collective or a worker's step may take "
                                             "before the engine is declared dead instead of hanging")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s: must be > 0, got {self.distributed_timeout_s}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` as vLLM spells it (a JSON object; a dict for ``LLM(...)``).

    ``ngram`` (prompt lookup): the drafts are the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens in its own prompt and output, for the largest n in
    [prompt_lookup_min, prompt_lookup_max] that occurs; no extra weights.

    ``draft_model``: a small model sharing the target's tokenizer (``model``: a .gguf file, an
    HF directory, or a config.json for random weights) drafts greedily, with a KV cache of its own
    beside the target's.

    ``mtp``: DeepSeek-V3/R1's multi-token-prediction layer, from the target checkpoint, drafts
    from the target's hidden states, chained on itself for k > 1."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model (method draft_model)
    # No speculation in a step that runs more than this many requests (None: never turned off).
    disable_by_batch_size: int | None = None
    # Cap each step's drafts where the engine's measured step times say they cost more than they
    # gain (control/spec_cost.py); false: every proposed draft runs. Not one of vLLM's keys.
    cost_model: bool = True

    METHODS = ("ngram", "draft_model", "mtp")

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            planned = " (not available yet)" if self.method == "eagle" else ""
            raise ValueError(f"speculative_config: method {self.method!r}{planned}; choose one of "
                             f"{', '.join(self.METHODS)}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method draft_model needs a \"model\" (the draft) and only it reads "
                             f"one; got method {self.method!r} with model {self.model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got "
                             f"{self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From a JSON string (the command line), a dict (``LLM(...)``), an instance or None; a
        clear ValueError for anything else, an unknown key included."""
        import json

        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        types = {"method": (str,), "model": (str,), "disable_by_batch_size": (int, type(None)), "cost_model": (bool,)}
        for key, v in value.items():
            want = types.get(key, (int,))
            if not isinstance(v, want) or (isinstance(v, bool) and bool not in want):
                raise ValueError(f"speculative_config: {key} must be {' or '.join(t.__name__ for t in want)}, "
                                 f"got {v!r}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = arg("cpu", "cuda or cpu (default: cuda when available)", user_default=None)
    attention_backend: str = arg("auto", "attention kernels: torch, triton, or auto (triton on CUDA, else torch)",
                                 choices=("auto", "torch", "triton"))
    enforce_eager: bool = arg(False, "no CUDA graphs")
    cuda_graph_mode: str = arg("full", "full: CUDA graphs for steps with prefill chunks too (Triton backend); "
                                       "decode: for decode-only steps", choices=("full", "decode"))
    # kernels/sample.py; off keeps the torch ops.
    fused_sampler: bool = arg(True, "sample, apply penalties and filter top-k/top-p/min-p with Triton kernels (GPU)")
    async_scheduling: bool | None = arg(None, "schedule the next step while the device runs this one "
                                              "(default: on for CUDA with one rank; tensor parallelism takes it "
                                              "when asked)")
    parallel: ParallelConfig = ParallelConfig()
    speculative_config: SpeculativeConfig | None = arg(
        None, "speculative decoding, as a JSON object: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
              "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5, \"disable_by_batch_size\": null}, or "
              "{\"method\": \"draft_model\", \"model\": \"path/to/draft\", \"num_speculative_tokens\": 4}, or "
              "{\"method\": \"mtp\", \"num_speculative_tokens\": 1} (DeepSeek-V3/R1)",
        type=SpeculativeConfig.parse)
    # Shows that a fault inside one request's sampling ends that request alone.
    fault_inject_sample_request: str | None = internal(
        None, "testing only: the sampler raises for the request (or parent request) with this id",
        env="DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST")
    # And one in making its text (the API process's, beside an engine core process).
    fault_inject_detokenize_request: str | None = internal(
        None, "testing only: detokenization raises for the request (or parent request) with this id",
        env="DEEPBATCH_FAULT_INJECT_DETOKENIZE_REQUEST")

    def __post_init__(self) -> None:
        _check_choices(self)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.scheduler.preemption_mode == "swap" and self.cache.swap_space <= 0:
            raise ValueError("preemption_mode: 'swap' needs a swap space (swap_space > 0 GiB)")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
