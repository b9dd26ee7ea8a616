"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Each token's keys and values are compressed into one latent ``c_kv`` (``kv_lora_rank`` = R dims,
after ``kv_a_layernorm``) plus one rotary key ``k_pe`` (P dims) shared by all heads; only
``[c_kv | k_pe]`` is cached::

    x -> kv_a_proj_with_mqa -> [ c_kv (R) | k_pe (P) ] -> norm(c_kv), rope(k_pe) -> cache
    x -> q_proj  (or q_a_proj -> q_a_layernorm -> q_b_proj) -> [ q_nope (Dn) | q_pe (P) ] per head

``kv_b_proj`` maps the latent to per-head ``k_nope`` (Dn) and ``v`` (Dv); its two halves are
absorbed instead of applied to every cached token::

    W_UK, W_UV = kv_b_proj.weight.view(H, Dn + Dv, R).split([Dn, Dv], 1)
    score = (q_nope W_UK) . c_kv + q_pe . k_pe      = q_nope . k_nope + q_pe . k_pe
    out   = o_proj( (softmax(score) @ c_kv) W_UV^T ) = o_proj( softmax(score) @ v )

That is attention with per-head query and key width R + P and value width R: in a decode the
latent is read once for all heads, which is what bounds it. Prefill chunks are bound by FLOPs
instead, where the absorbed form costs ``(2R + P) / (Dn + P + Dv)`` times the expanded one
(576 + 512 against 192 + 128 multiply-adds per key and head for DeepSeek-V2-Lite, 3.4x). ``prefill_mode``
(``ModelConfig.mla_prefill``, fixed at construction) picks the form of requests with more than one new token:

* ``"absorbed"``: every row of every step takes the absorbed path.
* ``"expanded"`` (the default): a chunk's attention is split at its first new token::

      keys [0, context_len)         cached latents: absorbed (mla_attention, context only)
      keys [context_len, seq_len)   this step's tokens: k_nope, v = kv_b_proj(c_kv), expanded
                                    (mla_prefill), merged with the context part by log-sum-exp

  One ``kv_b_proj`` GEMM over the step's tokens decompresses the new keys and values; nothing is
  gathered and no length is read on the host, so such steps replay CUDA graphs like any other.
  Decodes stay absorbed, and so does cached context (prefix hits, earlier chunks).

With ``kv_cache_dtype`` fp8 or int8 the latent cache is 8-bit, with one float32 scale per token
for ``c_kv`` and one for ``k_pe`` beside it (``kernels/kv_quant.py``); the write quantizes and the
absorbed kernels dequantize in registers. The expanded path takes this step's own ``c_kv`` and
``k_pe`` back from the cache too (dequantized, only the step's tokens), so every key and value any
path attends to is the cached one, and where a prompt is cut into chunks changes nothing.

Under tensor parallelism the heads are split (``q_proj``/``q_b_proj`` and ``kv_b_proj``
column-parallel, ``o_proj`` row-parallel); the latent is shared by all heads, so
``kv_a_proj_with_mqa`` and the latent cache are replicated on every rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepbatch.distributed.parallel_state import current_tp_group
from deepbatch.kernels.kv_quant import (
    MLA_SCALES_PER_TOKEN,
    SCALE_DTYPE,
    dequantize_latent_ref,
    quant_mode,
)
from deepbatch.kernels.mla_decode import mla_attention_ref
from deepbatch.kernels.mla_prefill import mla_prefill_ref
from deepbatch.kernels.reshape_and_cache import mla_reshape_and_cache_ref
from deepbatch.layers.attention import AttentionBackend
from deepbatch.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from deepbatch.layers.norm import RMSNorm
from deepbatch.layers.rotary import RotaryEmbedding, rope_parameters
from deepbatch.core.forward_batch import ForwardBatch


class MLARotaryEmbedding(nn.Module):
    """Rotary embedding of the ``qk_rope_head_dim`` dims (YaRN and the other scalings come from
    :class:`RotaryEmbedding`'s tables). DeepSeek checkpoints pair dims ``(2i, 2i+1)``
    (``interleaved``); the result comes out de-interleaved, ``[rotated evens | rotated odds]``,
    like transformers' V3 code. V2's complex-number form keeps the pairs in place; both apply one
    permutation to q and k, which leaves every ``q_pe . k_pe`` unchanged."""

    def __init__(self, config, rope_dim: int, max_position: int, interleaved: bool):
        super().__init__()
        self.rope = RotaryEmbedding(config, rope_dim, max_position)
        self.interleaved = interleaved

    def at(self, positions: torch.Tensor):
        """The rotation at ``positions``, looked up once per forward (see RotaryEmbedding.at)."""
        if not self.interleaved:
            return self.rope.at(positions)
        cos = self.rope.cos[positions].unsqueeze(1)  # [T, 1, P/2]
        sin = self.rope.sin[positions].unsqueeze(1)
        # q: [T, H, P], k: [T, 1, P]
        return lambda q, k: (_rotate_interleaved(q, cos, sin), _rotate_interleaved(k, cos, sin))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.at(positions)(q, k)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In float32 as transformers' V2 does (its complex product upcasts); P is small.
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def mla_softmax_scale(config) -> float:
    """``qk_head_dim**-0.5``, times ``mscale**2`` under YaRN with ``mscale_all_dim`` (the
    attention-temperature correction of transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """The whole MLA block, projections included; the runner binds its one latent cache."""

    def __init__(self, config, prefill_mode: str = "expanded"):
        super().__init__()
        if prefill_mode not in ("absorbed", "expanded"):
            raise ValueError(f"prefill_mode: absorbed or expanded, got {prefill_mode!r}")
        self.prefill_mode = prefill_mode  # module docstring
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        self.num_heads = current_tp_group().split(num_heads, "num_attention_heads")  # this rank's heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = getattr(config, "attention_bias", False)
        eps = config.rms_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * self.qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden, bias=bias)
        self.scale = mla_softmax_scale(config)
        self.latent_cache: torch.Tensor | None = None  # [num_blocks, block_size, 1, R + P]
        self.latent_scale: torch.Tensor | None = None  # 8-bit caches: [num_blocks, block_size, 2] float32
        self.backend: AttentionBackend = AttentionBackend()

    def cache_specs(self, cache_dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(per-token shape, dtype)`` of each paged tensor for a latent stored as
        ``cache_dtype``: the latent, then for fp8 and int8 its two per-token scales."""
        specs = [((1, self.kv_lora_rank + self.qk_rope_head_dim), cache_dtype)]
        if quant_mode(cache_dtype) != 0:
            specs.append(((MLA_SCALES_PER_TOKEN,), SCALE_DTYPE))
        return specs

    def bind(self, caches: list[torch.Tensor | None], backend: AttentionBackend) -> None:
        self.latent_cache, *scale = caches
        self.latent_scale = scale[0] if scale else None
        self.backend = backend

    def process_weights_after_loading(self) -> None:
        """The absorbed path reads ``kv_b_proj``'s matrix itself, so a quantized checkpoint's
        ``kv_b_proj`` is kept dequantized in the model dtype (it is small: R x H(Dn + Dv))."""
        self.kv_b_proj.dequantize_in_place()

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, Dn, R]`` and ``W_UV [H, Dv, R]``: views of ``kv_b_proj.weight``, no copies."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """``rope``: the rotation at this forward's positions (``MLARotaryEmbedding.at``)."""
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = rope(q_pe, k_pe.unsqueeze(1))  # [T, H, P], [T, 1, P]
        k_pe = k_pe[:, 0]
        if self.backend.name == "triton":
            from deepbatch.kernels.reshape_and_cache import mla_reshape_and_cache

            mla_reshape_and_cache(c_kv, k_pe, self.latent_cache, batch.slot_mapping, self.latent_scale)
        else:
            mla_reshape_and_cache_ref(c_kv, k_pe, self.latent_cache, batch.slot_mapping, self.latent_scale)

        o = self._attend(q_nope, q_pe, c_kv, k_pe, batch)
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))

    def _attend(self, q_nope, q_pe, c_kv, k_pe, batch: ForwardBatch) -> torch.Tensor:
        """``[T, H, Dv]``: every row through the latent space, or in expanded mode the rows of
        prefill chunks as the module docstring draws them."""
        T = q_nope.shape[0]
        w_uk, w_uv = self._absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [H, T, Dn] @ [H, Dn, R] -> [T, H, R]
        expanded = self.prefill_mode == "expanded" and batch.max_query_len > 1
        if not expanded:
            o_latent = self._latent_attention(q_latent, q_pe, batch)
        else:
            # Decodes over their whole context; chunks over their cached context only, with the
            # log-sum-exp that merges in their attention over the new tokens below.
            o_latent = torch.empty_like(q_latent)
            lse = torch.empty(T, self.num_heads, dtype=torch.float32, device=q_latent.device)
            self._latent_attention(q_latent, q_pe, batch, out=o_latent, max_q_len=1)
            self._latent_attention(q_latent, q_pe, batch, out=o_latent, context_lse=lse)
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [H, T, R] @ [H, R, Dv]
        if expanded:
            if self.latent_scale is not None:
                c_kv, k_pe = self._step_latents_as_cached(batch.slot_mapping, c_kv.dtype)
            kv = self.kv_b_proj(c_kv).view(T, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            if self.backend.name == "triton":
                from deepbatch.kernels.mla_prefill import mla_prefill

                mla_prefill(q_nope, q_pe, k_nope, k_pe, v, batch.query_start_loc, self.scale, batch.max_query_len,
                            o, lse)
            else:
                mla_prefill_ref(q_nope, q_pe, k_nope, k_pe, v, batch.query_start_loc, self.scale, o, lse)
        return o

    def _step_latents_as_cached(self, slot_mapping: torch.Tensor, dtype: torch.dtype):
        """This step's ``c_kv [T, R]`` and ``k_pe [T, P]`` read back from an 8-bit cache and
        dequantized: the values the absorbed path and later steps read for these tokens."""
        bs = self.latent_cache.shape[1]
        # Padding tokens (slot -1) read slot 0: finite values, in rows nothing reads.
        slots = slot_mapping.clamp(min=0)
        blocks, offsets = slots // bs, slots % bs
        latent = dequantize_latent_ref(self.latent_cache[blocks, offsets, 0], self.latent_scale[blocks, offsets],
                                       self.kv_lora_rank, dtype)
        return latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)

    def _latent_attention(self, q_latent, q_pe, batch: ForwardBatch, **kwargs) -> torch.Tensor:
        """``[T, H, R]``: absorbed attention over the latent cache (``kwargs``: ``out``,
        ``max_q_len``, ``context_lse`` of :func:`~deepbatch.kernels.mla_decode.mla_attention`)."""
        args = (q_latent, q_pe, self.latent_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                self.scale)
        if self.latent_scale is not None:
            kwargs["latent_scale"] = self.latent_scale
        if self.backend.name == "triton":
            from deepbatch.kernels.mla_decode import mla_attention

            return mla_attention(*args, batch.max_query_len, batch.max_seq_len, **kwargs)
        return mla_attention_ref(*args, **kwargs)
