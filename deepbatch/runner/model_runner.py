"""Runs one scheduled step on the model: build the ForwardBatch, forward, logits, sample.

The runner owns the KV cache tensors and binds them to the attention layers. Each layer says
what it needs through ``cache_specs(cache_dtype)`` (K and V of ``[num_kv_heads, head_dim]`` per
token for standard attention, plus their per-token scales for an int8 cache; one latent vector
for MLA, plus its two per-token scales for an fp8 or int8 cache) or, storing only the model dtype,
``cache_shapes()``; the runner allocates ``[num_blocks, block_size, *shape]`` for each, so every
layer shares the one block pool. The cache's dtype (``CacheConfig.kv_cache_dtype``) is the
runner's choice, not the model's. It sizes the pool with ``profile_num_blocks`` and returns the
number; nothing is written back into the config. With a swap space it also owns the host KV
pool (``runner/kv_swap.py``) and performs the step's swap copies before the forward.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from deepbatch.config import EngineConfig
from deepbatch.kernels.kv_quant import kv_cache_storage_dtype, quant_mode
from deepbatch.layers.attention import make_backend
from deepbatch.layers.mla import MultiHeadLatentAttention
from deepbatch.runner.cuda_graph import CudaGraphs, capture_or_none
from deepbatch.core.forward_batch import ForwardBatch
from deepbatch.core.request import Request
from deepbatch.layers.kv_scales import (calibration_token_ids, layers_without_scales, measure_kv_absmax,
                                        set_kv_scales, warn_missing_scales)
from deepbatch.runner.kv_swap import HostKVCache
from deepbatch.runner.persistent_batch import PersistentBatch
from deepbatch.runner.step_inputs import StepInputs, step_inputs
from deepbatch.sampling.penalty_state import bytes_per_row as penalty_bytes_per_row
from deepbatch.sampling.draft_rows import sampling_rows, step_drafts
from deepbatch.sampling.param_rows import StepParams
from deepbatch.sampling.prompt_logprobs import compute_prompt_logprobs
from deepbatch.sampling.pending_sample import PendingSample
from deepbatch.sampling.sampler import Sampler
from deepbatch.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def layer_cache_specs(layer, cache_dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(per-token shape, dtype)`` of each paged tensor of an attention layer's cache: its own
    ``cache_specs``, or its ``cache_shapes`` in ``cache_dtype`` (which must be the model dtype)."""
    if hasattr(layer, "cache_specs"):
        return layer.cache_specs(cache_dtype)
    return [(shape, cache_dtype) for shape in layer.cache_shapes()]


def block_bytes(specs: list[list[tuple[tuple[int, ...], torch.dtype]]], block_size: int) -> int:
    """Bytes of one block of ``block_size`` tokens over every layer's cache tensors."""
    return sum(block_size * math.prod(shape) * dtype.itemsize for layer in specs for shape, dtype in layer)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config, max_model_len: int):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.attn_layers = model.attention_layers()
        self.kv_cache_dtype = kv_cache_storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        self._cache_specs = [self._layer_cache_specs(a) for a in self.attn_layers]
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = make_backend(backend)
        # The sampling kernels on CUDA unless turned off (``fused_sampler=False``: the torch path).
        self.sampler = Sampler(hf_config.vocab_size, self.device, fused=None if config.fused_sampler else False,
                               fault_request_id=config.fault_inject_sample_request,
                               max_num_seqs=config.scheduler.max_num_seqs)
        self.kv_caches: list[list[torch.Tensor]] = []
        self.graphs: CudaGraphs | None = None
        # Each request's row, and the device token pool a pending input token is read from.
        self.batch = PersistentBatch(config.scheduler.max_num_seqs, self.device, self.max_blocks_per_seq)
        # The persistent rows of the last launched step's logits rows (``adopt_sampled``).
        self._sample_rows: torch.Tensor | None = None
        self.host_kv: HostKVCache | None = None
        # Every forward's final hidden states by KV slot, where an MTP drafter reads them
        # (``runner/mtp_runner.py``); None otherwise.
        self.hidden_cache: torch.Tensor | None = None

    # -- KV cache ---------------------------------------------------------------------------

    def _layer_cache_specs(self, layer, cache_dtype=None) -> list[tuple[tuple[int, ...], torch.dtype]]:
        cache_dtype = cache_dtype or self.kv_cache_dtype
        if not hasattr(layer, "cache_specs") and cache_dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype={self.config.cache.kv_cache_dtype!r}: {type(layer).__name__} keeps its "
                             f"cache in the model dtype only; use kv_cache_dtype='auto'")
        return layer_cache_specs(layer, cache_dtype)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over every layer: K/V in the cache dtype plus any scales beside them."""
        return block_bytes(self._cache_specs, self.block_size)

    def _alloc_caches(self, num_blocks: int, cache_dtype=None) -> list[list[torch.Tensor]]:
        """Caches for every layer in the configured format, or in ``cache_dtype`` (scratch)."""
        all_specs = self._cache_specs if cache_dtype is None else [self._layer_cache_specs(a, cache_dtype)
                                                                    for a in self.attn_layers]
        return [
            [torch.zeros((num_blocks, self.block_size, *shape), dtype=dtype, device=self.device)
             for shape, dtype in specs]
            for specs in all_specs
        ]

    def describe_kv_cache(self) -> str:
        """The cache format for the start-up log: dtype, scales, bytes per token."""
        name = self.config.cache.kv_cache_dtype
        per_token = self.kv_bytes_per_block() / self.block_size
        mode = quant_mode(self.kv_cache_dtype)
        if mode and any(isinstance(a, MultiHeadLatentAttention) for a in self.attn_layers):
            scales = ", float32 scales per token for c_kv and k_pe"
        else:
            scales = ("" if mode == 0 else ", per-layer K/V scales" if mode == 1
                      else ", float32 scale per token and KV head")
        return f"kv_cache_dtype {name} ({str(self.kv_cache_dtype).removeprefix('torch.')}{scales}), " \
               f"{per_token / 1024:.2f} KiB per token"

    def calibrate_kv_scales(self, all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """With ``calculate_kv_scales`` and an fp8 cache, measure the scales of every layer the
        checkpoint gave none (``layers/kv_scales.py``); a no-op otherwise. Every
        tensor-parallel rank calls it at the same point of start-up, with ``all_reduce_max``."""
        layers = layers_without_scales(self.attn_layers)
        if not (self.config.cache.calculate_kv_scales and quant_mode(self.kv_cache_dtype) == 1 and layers):
            return
        sched = self.config.scheduler
        n = min(sched.max_num_batched_tokens, self.max_model_len, 2048 if self.device.type == "cuda" else 512)
        ids = calibration_token_ids(self.sampler.vocab_size, n)
        absmax = measure_kv_absmax(layers, lambda: self._dummy_forward(n, ids, cache_dtype=self.dtype), self.device)
        set_kv_scales(layers, absmax if all_reduce_max is None else all_reduce_max(absmax), self.kv_cache_dtype)

    def profile_num_blocks(self, extra_bytes_per_block: int = 0) -> int:
        """How many KV blocks fit: the override if set; on a GPU, what ``gpu_memory_utilization``
        leaves after weights and the peak activation of a forward at the largest batch; on the
        CPU, the fixed ``cpu_kv_cache_bytes`` budget (capped to what the limits can use). Each
        block is counted with ``extra_bytes_per_block`` beside it (a draft model's block)."""
        cache = self.config.cache
        per_block = self.kv_bytes_per_block() + extra_bytes_per_block
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            return self._profile_cuda(per_block)
        useful = self.config.scheduler.max_num_seqs * self.max_blocks_per_seq
        return max(1, min(cache.cpu_kv_cache_bytes // per_block, useful))

    def _profile_cuda(self, per_block: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scheduler = self.config.scheduler
        num_tokens = min(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * self.max_model_len)
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory used by others (other processes, the CUDA context) is outside torch's view.
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        # Penalty state for a full batch of penalised requests (sampling/penalty_state.py).
        penalties = self.config.scheduler.max_num_seqs * penalty_bytes_per_row(self.sampler.vocab_size)
        budget = total * self.config.cache.gpu_memory_utilization - peak - max(non_torch, 0) - penalties
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise RuntimeError(
                f"gpu_memory_utilization={self.config.cache.gpu_memory_utilization} leaves no room for the KV cache "
                f"(weights+activations peak {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)"
            )
        return num_blocks

    @torch.no_grad()
    def _dummy_forward(self, num_tokens: int, input_ids: torch.Tensor | None = None, cache_dtype=None) -> None:
        """A forward over one prompt of ``num_tokens`` tokens (``input_ids``, else zeros) with a
        scratch KV cache just large enough for it (in ``cache_dtype``, else the cache's format),
        to measure peak activation memory or K/V ranges."""
        n_blocks = -(-num_tokens // self.block_size)
        scratch = self._alloc_caches(n_blocks, cache_dtype)
        self._bind(scratch)
        batch = self._synthetic_batch([num_tokens], [num_tokens], torch.arange(num_tokens, device=self.device),
                                      torch.arange(n_blocks, dtype=torch.int32, device=self.device)[None], input_ids)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        self.model.compute_logits(hidden[batch.logits_indices])
        del scratch, hidden
        self._bind(self.kv_caches)  # none before init_kv_cache; a tensor-parallel worker has its own

    def init_kv_cache(self, num_blocks: int) -> None:
        if quant_mode(self.kv_cache_dtype) == 1:
            warn_missing_scales(self.attn_layers, self.config.cache.kv_cache_dtype, self.kv_cache_dtype)
        self.kv_caches = self._alloc_caches(num_blocks)
        self._bind(self.kv_caches)
        logger.info("KV cache format: %s", self.describe_kv_cache())

    def init_swap_space(self, num_blocks: int) -> None:
        """The host pool for preemption by swap, laid out like the device cache."""
        self.host_kv = HostKVCache(self.kv_caches, num_blocks)

    def swap_blocks(self, out: SchedulerOutput) -> None:
        """The step's swap copies (outs, then ins); a no-op for steps without any."""
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            self.host_kv.copy(self.kv_caches, out.blocks_to_swap_out, out.blocks_to_swap_in)

    def measure_prefill_tokens_per_s(self, num_tokens: int) -> float:
        """Prompt tokens per second of one forward over ``num_tokens`` (the second of two, so
        compilation and allocator warm-up are not timed). Call before ``init_kv_cache``."""
        self._dummy_forward(num_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self._dummy_forward(num_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return num_tokens / max(time.perf_counter() - t0, 1e-9)

    def capture_cuda_graphs(self) -> None:
        """Compile the kernels, then capture step graphs (after the KV cache exists); a no-op on
        the CPU, kernels only when eager.
        Steps with prefill chunks and verification steps get graphs too (``mixed_graphs``)."""
        if self.device.type != "cuda":
            return
        self._warm_up_kernels()
        if self.config.enforce_eager:
            return
        mixed = self.mixed_graphs()
        sched, spec = self.config.scheduler, self.config.speculative_config
        graphs = CudaGraphs(self.model, sched.max_num_seqs, self.max_blocks_per_seq, self.max_model_len, self.device,
                            max_num_batched_tokens=sched.max_num_batched_tokens if mixed else None,
                            verify_query_len=spec.num_speculative_tokens + 1 if spec is not None else None)
        self.graphs = capture_or_none(graphs, "decode")

    def mixed_graphs(self) -> bool:
        """Whether steps with prefill chunks get CUDA graphs: with ``cuda_graph_mode="full"``, the
        Triton backend (the torch one reads lengths on the host), one process (not measured with
        tensor parallelism)."""
        return (self.config.cuda_graph_mode == "full" and self.backend.name == "triton"
                and self.config.parallel.tensor_parallel_size == 1)

    @torch.no_grad()
    def _warm_up_kernels(self) -> None:
        """Compile every Triton kernel variant eager steps can meet, before the first request:
        a decode over a long context (the split-KV path), then a decode beside a prefill chunk
        of each tile class, and the sampler's. Compiling mid-traffic stalls a server for seconds.
        Nothing is written to the cache (slots -1); block 0 is read as context."""
        bs, budget = self.block_size, self.config.scheduler.max_num_batched_tokens
        context = min(self.max_model_len, 1024)
        for chunk in (0, 2, 8, 16, 32, 64, 512):
            if chunk + 1 > budget or chunk > self.max_model_len:
                continue
            q_lens, seq_lens = ([1], [context]) if chunk == 0 else ([1, chunk], [context, chunk])
            batch = self._synthetic_batch(q_lens, seq_lens, torch.full((sum(q_lens),), -1, device=self.device),
                                          torch.zeros(len(q_lens), -(-max(seq_lens) // bs), dtype=torch.int32,
                                                      device=self.device))
            self.model(batch.input_ids, batch.positions, batch)
        self.sampler.warm_up()
        torch.cuda.synchronize(self.device)

    def _synthetic_batch(self, q_lens: list[int], seq_lens: list[int], slot_mapping: torch.Tensor,
                         block_tables: torch.Tensor, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """A start-up batch: ``q_lens[i]`` new tokens (``input_ids``, else zeros) ending sequence
        ``i`` of ``seq_lens[i]`` tokens; the last token's logits."""
        d, n = self.device, sum(q_lens)
        return ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.long, device=d) if input_ids is None else input_ids.to(d),
            positions=torch.cat([torch.arange(s - q, s, device=d)
                                 for q, s in zip(q_lens, seq_lens)]) % self.max_model_len,
            slot_mapping=slot_mapping.long(), block_tables=block_tables, logits_indices=torch.tensor([n - 1], device=d),
            query_start_loc=torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=d),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=d), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens))

    def _bind(self, caches) -> None:
        for i, a in enumerate(self.attn_layers):
            a.bind(caches[i] if caches else [None] * len(self._cache_specs[i]), self.backend)

    # -- the step ---------------------------------------------------------------------------

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        return self._build_batch(out).batch

    def _build_batch(self, out: SchedulerOutput) -> StepInputs:
        return step_inputs(out, self.block_size, self.batch, self.device)

    @torch.no_grad()
    def launch(self, out: SchedulerOutput) -> PendingSample | None:
        """Queue the step on the device and return without waiting (None when no request
        samples and none computes prompt logprobs). Inputs may be pending tokens of the previous
        launch."""
        # Before the forward, which may rewrite blocks freed by this step's swap-outs; stream
        # order puts the copies after the previous launch's writes.
        self.swap_blocks(out)
        step = self._build_batch(out)
        batch = step.batch
        self._sample_rows = step.sample_rows_device
        hidden = self.graphs.run(batch) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch)
        if self.hidden_cache is not None:
            self.hidden_cache.index_copy_(0, batch.slot_mapping, hidden)
        sampling: list[Request] = [s.request for s in out.scheduled if s.samples]
        if step.prompt_rows:
            return self._sample_with_prompt_logprobs(hidden, step, sampling, out)
        if not sampling:
            return None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if logits is None:  # a tensor-parallel worker: its logits went to rank 0, which samples
            return None
        return self._sample(logits, sampling, out, step)

    def _sample(self, logits: torch.Tensor, sampling: list[Request], out: SchedulerOutput,
                step: StepInputs) -> PendingSample:
        """Rows ``[0, len(sampling))`` are the sampled requests' newest positions; any after them
        are the draft positions of speculative decoding, drawn like the rest
        (``sampling/draft_rows.py``). Their parameters are gathered from the persistent rows."""
        n = len(sampling)
        drafts = step_drafts(out.scheduled) if logits.shape[0] > n else []
        params = StepParams.gather(self.batch.params, step.sample_rows[:logits.shape[0]], step.sample_rows_device)
        pending = self.sampler.sample(logits, sampling_rows(sampling, drafts) if drafts else sampling, params)
        self.adopt_sampled(pending.token_ids[:n])
        if drafts:
            pending.attach_drafts(n, drafts)
        return pending

    def adopt_sampled(self, token_ids: torch.Tensor) -> None:
        """The last launched step's sampled ids (``token_ids[i]`` is its ``i``-th sampling
        request's) into the token pool, where the next step reads a pending input token; a
        tensor-parallel worker gets rank 0's."""
        self.batch.record_sampled(self._sample_rows[:len(token_ids)], token_ids)

    def _sample_with_prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs, sampling: list[Request],
                                     out: SchedulerOutput) -> PendingSample | None:
        """A step that also computes prompt logprobs. Every tensor-parallel rank runs it, making
        the same ``compute_logits`` calls: the sampled rows' first, then the prompt rows'."""
        pending = None
        if sampling:
            logits = self.model.compute_logits(hidden[step.batch.logits_indices])
            if logits is not None:
                pending = self._sample(logits, sampling, out, step)
        prompt = compute_prompt_logprobs(self.model.compute_logits, hidden, step.prompt_rows,
                                         self.sampler.vocab_size)
        if prompt is None:  # a tensor-parallel worker
            return None
        if pending is None:  # no request samples: only prompt logprobs come back
            pending = PendingSample.empty(self.device)
        pending.attach_prompt_logprobs(prompt)
        return pending

    # -- lifecycle (what a tensor-parallel executor adds to; trivial in one process) ---------

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop its per-request state (its row, the
        sampler's penalty slot; seeded sampling is stateless)."""
        self.sampler.forget(request_id)
        self.batch.release(request_id)

    def check_health(self) -> None:
        """Raises EngineDeadError when the runner can no longer run steps; in one process a
        failing step raises by itself, so there is nothing to check."""

    def add_fault_listener(self, callback) -> None:
        """``callback()`` runs when the runner fails outside a step; one process never does."""

    def shutdown(self) -> None:
        """Release what outlives the runner (worker processes); nothing in one process."""
