"""The throughput ceiling of a workload on a GPU, from the model config alone.

A decode step with batch B at contexts L_i reads the weights once and each sequence's KV:
``t_mem = (weight_bytes + sum_i L_i * kv_bytes_per_token) / BW``,
``t_compute = B * 2 * active_params / F``; the step takes ``max`` of the two. Prefill runs at
compute cost: the weights' ``2 * active_params`` per token plus attention's QK and PV products
over each token's causal context, which dominate for prompts of several thousand tokens. Under a
sliding window ``W`` a token attends to (and a decode step reads the KV of) at most ``W`` tokens.
Requests run in lockstep waves of at most ``max_batch``, and of no more than the KV pool holds
(``kv_capacity_tokens``): each request holds its whole context, or ``W`` tokens under a window. ``kv_bytes_per_token`` is
the cache's own: an 8-bit ``kv_cache_dtype`` stores one byte per element, plus int8's per-token
scales (and, for an MLA latent, both formats' two per-token scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepbatch.kernels.kv_quant import (
    kv_bytes_per_token_head,
    kv_cache_storage_dtype,
    mla_kv_bytes_per_token,
)

H200_BW = 4.3e12  # bytes/s, device-to-device copy measured on the lent H200
H200_FLOPS = 790e12  # bf16 dense matmul, measured


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: float
    active_params: float
    kv_bytes_per_token: float
    # FLOPs per (query token, context token) pair: QK^T and PV over every head of every layer.
    attn_flops_per_pair: float = 0.0


_MODEL_DTYPE = {2: torch.bfloat16, 4: torch.float32}


def model_cost(cfg, dtype_bytes: int = 2, kv_cache_dtype: str = "auto", weight_bits: float | None = None) -> ModelCost:
    """Weights in ``dtype_bytes`` per parameter, or the decoder layers' projections (experts
    included) in ``weight_bits`` each where the weights are quantized (the embedding, the head and
    MLA's ``kv_b_proj``, kept dequantized, stay in ``dtype_bytes``); the KV cache as
    ``kv_cache_dtype`` stores it."""
    kv_dtype = kv_cache_storage_dtype(kv_cache_dtype, _MODEL_DTYPE.get(dtype_bytes, torch.bfloat16))
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    if getattr(cfg, "kv_lora_rank", None):  # MLA (DeepSeek-V2/V3)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = h * heads * qk if not getattr(cfg, "q_lora_rank", None) else h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        attn = q + kv + heads * cfg.v_head_dim * h
        kept_16bit = layers * cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b_proj
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # Prefill runs the expanded form: per head a (nope + rope)-wide QK and a v-wide PV.
        pair = 2 * layers * heads * (qk + cfg.v_head_dim)
        # 8-bit: a byte per element plus two float32 scales (c_kv's, k_pe's) per token.
        kv_tok = layers * (latent * dtype_bytes if kv_cache_dtype == "auto"
                           else mla_kv_bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim, kv_dtype))
    else:
        kvh = getattr(cfg, "num_key_value_heads", None) or heads
        attn = h * head_dim * (heads + 2 * kvh) + heads * head_dim * h
        kept_16bit = 0
        pair = 2 * layers * heads * 2 * head_dim
        per_head = head_dim * dtype_bytes if kv_cache_dtype == "auto" else kv_bytes_per_token_head(head_dim, kv_dtype)
        kv_tok = layers * 2 * kvh * per_head
    n_experts = getattr(cfg, "n_routed_experts", None)
    if n_experts:
        dense_layers = getattr(cfg, "first_k_dense_replace", 0)
        moe_i = cfg.moe_intermediate_size
        shared = (getattr(cfg, "n_shared_experts", 0) or 0) * 3 * h * moe_i
        mlp_all = dense_layers * 3 * h * cfg.intermediate_size + (layers - dense_layers) * (n_experts * 3 * h * moe_i + shared)
        mlp_active = dense_layers * 3 * h * cfg.intermediate_size + (layers - dense_layers) * (
            cfg.num_experts_per_tok * 3 * h * moe_i + shared)
    else:
        mlp_all = mlp_active = layers * 3 * h * cfg.intermediate_size
    embed = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    total = layers * attn + mlp_all + embed
    active = layers * attn + mlp_active + vocab * h  # the head runs per token; the embedding is a lookup
    if weight_bits is None:
        return ModelCost(total * dtype_bytes, active, kv_tok, pair)
    linear = layers * attn + mlp_all - kept_16bit
    return ModelCost(linear * weight_bits / 8 + (embed + kept_16bit) * dtype_bytes, active, kv_tok, pair)


def causal_pairs(n: int, window: int | None = None) -> int:
    """(query, key) pairs of causal attention over ``n`` tokens, each seeing at most ``window``."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def workload_ceiling(cost: ModelCost, prompt_lens, output_lens, max_batch: int = 256,
                     bw: float = H200_BW, flops: float = H200_FLOPS, window: int | None = None,
                     kv_capacity_tokens: int | None = None) -> float:
    """Output tokens per second at the ceiling."""
    def seen(ctx: int) -> int:
        return ctx if window is None else min(ctx, window)

    t = sum(prompt_lens) * 2 * cost.active_params / flops
    t += sum(causal_pairs(n, window) for n in prompt_lens) * cost.attn_flops_per_pair / flops
    held = max(seen(p + o) for p, o in zip(prompt_lens, output_lens))
    if kv_capacity_tokens is not None:
        max_batch = max(1, min(max_batch, kv_capacity_tokens // held))
    order = list(range(len(prompt_lens)))
    for start in range(0, len(order), max_batch):
        wave = order[start : start + max_batch]
        steps = max(output_lens[i] for i in wave)
        for s in range(steps):
            live = [i for i in wave if output_lens[i] > s]
            ctx = sum(seen(prompt_lens[i] + s) for i in live)
            t_mem = (cost.weight_bytes + ctx * cost.kv_bytes_per_token) / bw
            t_cmp = len(live) * 2 * cost.active_params / flops
            t += max(t_mem, t_cmp)
    return sum(output_lens) / t
