"""Llama-family decoder: Llama 2/3 (SmolLM2, DeepSeek-Coder, DeepSeek-LLM), Mistral (a sliding
window on every layer), Qwen2 (DeepSeek-R1-Distill-Qwen, q/k/v bias) and Qwen3 (per-head q/k
RMSNorm); Qwen2/Qwen3 may window some layers (``use_sliding_window``, ``layer_types``).

    x -> embed -> [ RMSNorm -> attention(rotary, paged KV) -> +res -> RMSNorm -> gated MLP -> +res ] x L
      -> RMSNorm -> lm_head (only at the rows that are sampled)

Each layer's window comes from ``config_checks.layer_sliding_windows``, which follows
transformers; fields the file does not implement were refused before it is built.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from deepbatch.layers.attention import PagedAttention
from deepbatch.layers.decoder import DecoderStack, PreNormDecoderLayer
from deepbatch.layers.linear import QKVParallelLinear, RowParallelLinear
from deepbatch.layers.mlp import GatedMLP
from deepbatch.layers.norm import RMSNorm
from deepbatch.layers.rotary import RotaryAt, RotaryEmbedding
from deepbatch.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from deepbatch.models.config_checks import layer_sliding_windows
from deepbatch.core.forward_batch import ForwardBatch

# An fp8 KV cache's per-layer scales, as vLLM and llm-compressor name them.
_KV_SCALE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.[kv]_scale$")


def check_kv_scale(name: str, tensor: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``tensor`` if it is a usable KV cache scale: one float (any shape with one element) or one
    per KV head, every entry finite and > 0; else a load error naming the tensor. A scale the
    cache would silently misuse (a negative one flips every K, NaN poisons every score) must stop
    the load instead."""
    per_head = tensor.dim() == 1 and tensor.numel() == num_kv_heads
    if not tensor.is_floating_point() or not (tensor.numel() == 1 or per_head):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be a float scalar (or one per KV head, "
                         f"{num_kv_heads}), got {tensor.dtype} of shape {tuple(tensor.shape)}")
    values = tensor.detach().float().flatten().tolist()
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be finite and > 0, got {values}")
    return tensor


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, o_bias: bool, sliding_window: int | None):
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                                   sliding_window=sliding_window)

    def forward(self, x: torch.Tensor, rope: RotaryAt, batch: ForwardBatch):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = rope(q, k, self.q_norm, self.k_norm)  # per-head norm, then rotation
        else:
            q, k = rope(q, k)
        o = self.attn(q, k, v, batch)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, o_bias: bool, sliding_window: int | None):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm, o_bias, sliding_window)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(DecoderStack):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, o_bias: bool, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qkv_bias, qk_norm, o_bias, w) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_position)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # Whether config.attention_bias gives q/k/v and o_proj biases (Llama, Qwen3; not Qwen2).
    reads_attention_bias = True
    # checkpoint name fragment -> (our fragment, shard index in the merged weight)
    stacked_params = [
        ("q_proj", "qkv_proj", 0),
        ("k_proj", "qkv_proj", 1),
        ("v_proj", "qkv_proj", 2),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    def __init__(self, config, max_position: int):
        super().__init__()
        self.config = config
        attention_bias = self.reads_attention_bias and bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, self.qkv_bias or attention_bias, self.qk_norm, attention_bias, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits; None on tensor-parallel ranks other than 0."""
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return head.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights) -> set[str]:
        """Copy ``(name, tensor)`` pairs in HF naming into the parameters; returns the names of
        parameters that were loaded. A layer's ``self_attn.k_scale``/``v_scale`` (not parameters)
        go to its attention's ``load_kv_scale``."""
        params = dict(self.named_parameters())
        loaded = set()
        num_kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            scale = _KV_SCALE.match(name)
            if scale:
                try:
                    attn = self.get_submodule(scale.group(1)).attn
                except AttributeError:
                    raise ValueError(f"checkpoint tensor {name!r} has no attention layer in {type(self).__name__}") from None
                # Checked and kept whatever the cache dtype: only an fp8 cache reads them.
                attn.load_kv_scale(name, check_kv_scale(name, tensor, num_kv_heads))
                continue
            for src, dst, shard in self.stacked_params:
                if f".{src}." in name:
                    target = name.replace(f".{src}.", f".{dst}.")
                    if target not in params:  # e.g. an fp8 checkpoint's k_proj.weight_scale
                        raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                    module = self.get_submodule(target.rsplit(".", 1)[0])
                    module.weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                module = self.get_submodule(name.rsplit(".", 1)[0])
                loader = getattr(module, "weight_loader", None)
                if loader is not None:
                    loader(params[name], tensor)
                else:
                    if params[name].shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
                    params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded


    def export_weights(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of ``load_weights`` for one parameter: HF-named tensors (merged
        projections split back into their checkpoint parts)."""
        parts = [(src, shard) for src, dst, shard in self.stacked_params if f".{dst}." in name]
        if not parts:
            return {name: tensor}
        dst = next(d for _, d, _ in self.stacked_params if f".{d}." in name)
        module = self.get_submodule(name.rsplit(".", 1)[0])
        return {
            name.replace(f".{dst}.", f".{src}."): tensor.narrow(0, module.offsets[shard], module.out_sizes[shard])
            for src, shard in parts
        }


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer (``sliding_window``; None: full attention)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    reads_attention_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
