"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and DeepSeekMoE.

    x -> embed -> [ RMSNorm -> MLA(latent paged cache) -> +res -> RMSNorm -> FFN -> +res ] x L
      -> RMSNorm -> lm_head (only at the rows that are sampled)

    FFN = gated MLP in the first ``first_k_dense_replace`` layers, DeepSeekMoE after them.

V3 differs only in its router (sigmoid scores with a correction bias, grouped top-k, normalised
weights) and in a switch for the rotary layout. Either may have a q LoRA (``q_lora_rank``; V2-Lite
has none). The multi-token-prediction layers V3 checkpoints carry (``model.layers.{L}...`` past
``num_hidden_layers``, ``num_nextn_predict_layers`` of them) are loaded and kept
(``model.mtp_layers``) for speculative decoding (``method: mtp``, ``runner/mtp_runner.py``);
normal decoding does not run them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepbatch.layers.decoder import DecoderStack, PreNormDecoderLayer
from deepbatch.layers.linear import Linear
from deepbatch.layers.mla import MLARotaryEmbedding, MultiHeadLatentAttention
from deepbatch.layers.moe import DeepseekMoE, TopKRouter
from deepbatch.layers.mlp import GatedMLP
from deepbatch.layers.norm import RMSNorm
from deepbatch.layers.quantization.base import quantization_scope
from deepbatch.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from deepbatch.core.forward_batch import ForwardBatch

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# One expert's tensor: its weight, or a quantized format's extra tensors (``weight_scale_inv`` ...),
# which go to the stacked parameter of the same name (``gate_up_proj_scale_inv``).
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight\w*)$")


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, router_kwargs: dict, mla_prefill: str):
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = MultiHeadLatentAttention(config, prefill_mode=mla_prefill)
        # As in transformers: every layer from first_k_dense_replace on is MoE (moe_layer_freq is 1
        # in every released checkpoint and transformers ignores it).
        if layer_idx >= config.first_k_dense_replace:
            moe_i = config.moe_intermediate_size
            shared = (GatedMLP(hidden, moe_i * config.n_shared_experts, reduce_results=False)
                      if config.n_shared_experts else None)
            router = TopKRouter(hidden, config.n_routed_experts, config.num_experts_per_tok, **router_kwargs)
            self.mlp = DeepseekMoE(router, hidden, moe_i, shared)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """A DeepSeek-V3 multi-token-prediction module, which predicts one token further ahead::

        h' = layer( eh_proj([ enorm(embed(next token)) | hnorm(h) ]) ) -> shared_head.norm -> head

    The embedding and the output head are the main model's (V3 shares them; the checkpoint's
    copies, ``embed_tokens`` and ``shared_head.head``, are not loaded again). Normal decoding
    does not run it and binds it no cache; the MTP drafter (``runner/mtp_runner.py``) runs it
    with a latent cache of its own."""

    def __init__(self, config, layer_idx: int, router_kwargs: dict, mla_prefill: str):
        super().__init__(config, layer_idx, router_kwargs, mla_prefill)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        with quantization_scope(None):  # a 16-bit projection even in FP8 checkpoints
            self.eh_proj = Linear(2 * hidden, hidden)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps)


class DeepseekModel(DecoderStack):
    def __init__(self, config, max_position: int, router_kwargs: dict, rope_interleave: bool, mla_prefill: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, router_kwargs, mla_prefill) for i in range(config.num_hidden_layers)
        )
        num_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        self.mtp_layers = nn.ModuleList(
            DeepseekMTPLayer(config, config.num_hidden_layers + i, router_kwargs, mla_prefill) for i in range(num_mtp)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MLARotaryEmbedding(config, config.qk_rope_head_dim, max_position, rope_interleave)


class DeepseekV2ForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fragment, shard index in the merged weight)
    stacked_params = [
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    # Options of ModelConfig that build_model passes to this class's constructor.
    construction_options = ("mla_prefill",)

    def __init__(self, config, max_position: int, mla_prefill: str = "expanded"):
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, max_position, self.router_kwargs(config), self.rope_interleave(config),
                                   mla_prefill)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    @staticmethod
    def router_kwargs(config) -> dict:
        # transformers' V2 router never normalises the top-k weights (no released V2 sets
        # norm_topk_prob) and always scores with softmax.
        return dict(
            scoring_func="softmax",
            topk_method=getattr(config, "topk_method", None) or "greedy",
            n_group=getattr(config, "n_group", None),
            topk_group=getattr(config, "topk_group", None),
            norm_topk_prob=False,
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
        )

    @staticmethod
    def rope_interleave(config) -> bool:
        return True  # V2 rotates (2i, 2i+1) pairs as complex numbers

    def forward(self, input_ids, positions, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits; None on tensor-parallel ranks other than 0."""
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return head.compute_logits(hidden)

    def attention_layers(self) -> list[MultiHeadLatentAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def load_weights(self, weights) -> set[str]:
        """Copy ``(name, tensor)`` pairs in HF naming into the parameters; returns the names of
        parameters that were loaded. Experts come one per tensor (``experts.{e}.gate_proj.weight``,
        as checkpoints and ``save_pretrained`` write them) or stacked (``experts.gate_up_proj``)."""
        params = dict(self.named_parameters())
        loaded = set()
        num_layers = self.config.num_hidden_layers
        num_mtp = len(self.model.mtp_layers)
        for name, tensor in weights:
            layer = _LAYER_INDEX.match(name)
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed
            if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                continue  # fp8 KV scales of an MHA cache: the 8-bit latent cache scales each token itself
            if layer and int(layer.group(1)) >= num_layers:
                index, rest = int(layer.group(1)) - num_layers, name[layer.end():]
                if index >= num_mtp or rest.startswith(("embed_tokens.", "shared_head.head.")):
                    continue  # beyond the configured MTP layers; or the main model's shared embedding/head
                name = f"model.mtp_layers.{index}.{rest}"
            if (self.tie_word_embeddings and name == "lm_head.weight") or tensor.numel() == 0:
                continue  # tied; or transformers' empty shared experts when n_shared_experts == 0
            expert = _EXPERT.search(name)
            if expert:
                e, part, suffix = int(expert.group(1)), expert.group(2), expert.group(3)
                stacked = "gate_up_proj" if part in ("gate_proj", "up_proj") else "down_proj"
                target = name[: expert.start()] + f".experts.{stacked}" + suffix.removeprefix("weight")
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                self.get_submodule(target.rsplit(".", 1)[0]).weight_loader(params[target], tensor, (e, part))
                loaded.add(target)
                continue
            for src, dst, shard in self.stacked_params:
                if f".{src}." in name:
                    target = name.replace(f".{src}.", f".{dst}.")
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                    self.get_submodule(target.rsplit(".", 1)[0]).weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                loader = getattr(self.get_submodule(name.rsplit(".", 1)[0]), "weight_loader", None)
                if loader is not None:
                    loader(params[name], tensor)
                else:
                    if params[name].shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
                    params[name].data.copy_(tensor)
                loaded.add(name)
        if num_mtp and not any(n.startswith("model.mtp_layers.") for n in loaded):
            # A checkpoint without them (transformers' save_pretrained writes none): nothing to keep.
            self.model.mtp_layers = nn.ModuleList()
        return loaded

    def export_weights(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of ``load_weights`` for one parameter, in transformers' in-memory names
        (what ``load_state_dict`` of its model takes): merged gate/up split back; stacked experts
        kept stacked, as transformers holds them."""
        if ".experts." in name:
            return {name: tensor}
        dst = next((d for _, d, _ in self.stacked_params if f".{d}." in name), None)
        if dst is None:
            return {name: tensor}
        module = self.get_submodule(name.rsplit(".", 1)[0])
        return {
            name.replace(f".{dst}.", f".{src}."): tensor.narrow(0, module.offsets[shard], module.out_sizes[shard])
            for src, d, shard in self.stacked_params if d == dst
        }


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def router_kwargs(config) -> dict:
        # transformers' V3 router is always sigmoid + correction bias + grouped top-k.
        return dict(
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=config.routed_scaling_factor,
        )

    @staticmethod
    def rope_interleave(config) -> bool:
        return bool(getattr(config, "rope_interleave", True))
