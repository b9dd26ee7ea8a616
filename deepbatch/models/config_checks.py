"""What a model's config asks for that deepbatch does not do: refused at load, never ignored.

Each registered architecture names its config fields in three sets:

    implemented   the model file reads the field and follows any value it may take
    neutral       the field never changes inference (token ids, dropout, initialisation, ...)
    limited       implemented at some values only: anything else is refused

Fields that other model families use to change the math (logit soft-capping, embedding or
logit multipliers, chunked attention, ...) are refused on every architecture that does not name
them, whenever they are set to something other than their no-op value. A refusal is a
``ValueError`` naming the model and the field, raised before any weight is read.
``tests/models/test_config_checks.py`` walks the transformers config class of every registered
architecture and fails on a field none of the three sets names, so a field transformers adds
gets a decision instead of being served in silence.

It also says which attention window each decoder layer has (``layer_sliding_windows``), as
transformers applies them, and which window the KV cache may free blocks behind
(``kv_sliding_window``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepbatch.layers.rotary import rope_parameters
from deepbatch.models.architectures import architecture_of

FULL, SLIDING = "full_attention", "sliding_attention"
# Rope types whose tables are fixed at load: "dynamic" and "longrope" change their frequencies
# with the sequence's length at run time, which one table per position cannot follow.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class Limit:
    """A field implemented only where ``ok(value)``; ``supported`` says which values, for the error;
    ``refused_example`` is a value that must be refused (the walking test sets it)."""

    ok: Callable[[Any], bool]
    supported: str
    refused_example: Any


def _unset(value) -> bool:
    return value is None or value is False or value == 0


def _one(value) -> bool:
    return value is None or value == 1


def _is_silu(value) -> bool:
    return value in ("silu", "swish")


def _rope_ok(params) -> bool:
    params = params or {}
    return (params.get("rope_type", params.get("type", "default")) in SUPPORTED_ROPE_TYPES
            and _one(params.get("partial_rotary_factor")))


def _window_ok(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _layer_types_ok(value) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and all(t in (FULL, SLIDING) for t in value))


def _all_full(value) -> bool:
    return value is None or all(t == FULL for t in value)


# Other families' math, refused wherever an architecture does not name the field.
FOREIGN: dict[str, Limit] = {
    "attn_logit_softcapping": Limit(_unset, "unset (no attention logit soft-capping)", 50.0),
    "final_logit_softcapping": Limit(_unset, "unset (no final logit soft-capping)", 30.0),
    "query_pre_attn_scalar": Limit(lambda v: v is None, "unset (scores scaled by head_dim**-0.5)", 256),
    "attention_chunk_size": Limit(lambda v: v is None, "unset (no chunked attention)", 8192),
    "no_rope_layers": Limit(lambda v: v is None or all(v), "unset or all 1 (rotary on every layer)", [1, 0]),
    "use_qk_norm": Limit(_unset, "false", True),
    "qk_layernorm": Limit(_unset, "false", True),
    "clip_qkv": Limit(lambda v: v is None, "unset", 8.0),
    "logit_scale": Limit(_one, "unset or 1", 0.5),
    "logits_scaling": Limit(_one, "unset or 1", 8.0),
    "embedding_multiplier": Limit(_one, "unset or 1", 12.0),
    "residual_multiplier": Limit(_one, "unset or 1", 0.22),
    "attention_multiplier": Limit(lambda v: v is None, "unset (scores scaled by head_dim**-0.5)", 0.015625),
    "partial_rotary_factor": Limit(_one, "unset or 1 (rotary over the whole head)", 0.5),
    "rotary_pct": Limit(_one, "unset or 1 (rotary over the whole head)", 0.25),
    "use_parallel_residual": Limit(_unset, "false", True),
    "parallel_attn": Limit(_unset, "false", True),
    "alibi": Limit(_unset, "false", True),
    "sliding_window_pattern": Limit(lambda v: v is None, "unset", 6),
    "num_local_experts": Limit(lambda v: v is None or v <= 1, "unset (a dense model)", 8),
    "hidden_activation": Limit(lambda v: v is None or _is_silu(v), "unset or silu", "gelu_pytorch_tanh"),
    # Windows on an architecture whose model file has none.
    "sliding_window": Limit(lambda v: v is None, "unset: this architecture has no sliding-window attention", 4096),
    "use_sliding_window": Limit(_unset, "false: this architecture has no sliding-window attention", True),
    "layer_types": Limit(_all_full, f"unset or all {FULL!r}", [SLIDING, FULL]),
    # Biases the model file would not read.
    "attention_bias": Limit(_unset, "false (this model file has no such biases)", True),
    "mlp_bias": Limit(_unset, "false (this model file has no MLP biases)", True),
}


@dataclass(frozen=True)
class ArchitectureFields:
    implemented: frozenset[str]
    neutral: frozenset[str]
    limited: dict[str, Limit] = field(default_factory=dict)

    def names(self) -> frozenset[str]:
        return self.implemented | self.neutral | frozenset(self.limited)


_NEUTRAL = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout",
    # Splits Llama's GEMMs into pretraining_tp slices: the same products summed in another order.
    "pretraining_tp",
})
_DECODER = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
})
_COMMON_LIMITS = {
    "hidden_act": Limit(_is_silu, "silu", "gelu"),
    "rope_parameters": Limit(_rope_ok, f"rope_type one of {', '.join(SUPPORTED_ROPE_TYPES)}, over the whole head",
                             {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
}
_QWEN_WINDOWS = {
    "sliding_window": Limit(_window_ok, "an int >= 1 or unset", 0),
    "layer_types": Limit(_layer_types_ok, f"a list of {FULL!r} / {SLIDING!r}", [FULL, "chunked_attention"]),
}

_LLAMA_FAMILY = _DECODER | {"num_key_value_heads", "head_dim"}
_DEEPSEEK = _DECODER | {
    "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "n_group", "topk_group", "n_routed_experts",
    "n_shared_experts", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "routed_scaling_factor",
    "num_experts_per_tok", "moe_intermediate_size", "attention_bias",
}
# MLA has no KV heads of its own, and qk_head_dim / head_dim are derived from the ranks above;
# the multi-token-prediction layers are loaded but not run; the rest is training only.
_DEEPSEEK_NEUTRAL = _NEUTRAL | {"num_key_value_heads", "qk_head_dim", "head_dim", "num_nextn_predict_layers",
                                "ep_size", "aux_loss_alpha", "seq_aux"}
_DEEPSEEK_LIMITS = {
    **_COMMON_LIMITS,
    # Dense layers read it; the shared and routed experts have no bias.
    "mlp_bias": Limit(_unset, "false (the experts have no MLP biases)", True),
    "moe_layer_freq": Limit(_one, "1 (every layer from first_k_dense_replace on is MoE)", 2),
}

ARCHITECTURES: dict[str, ArchitectureFields] = {
    "LlamaForCausalLM": ArchitectureFields(_LLAMA_FAMILY | {"attention_bias", "mlp_bias"}, _NEUTRAL, _COMMON_LIMITS),
    "MistralForCausalLM": ArchitectureFields(_LLAMA_FAMILY | {"sliding_window"}, _NEUTRAL, {
        **_COMMON_LIMITS,
        "sliding_window": _QWEN_WINDOWS["sliding_window"],
        # transformers' Mistral windows every layer and ignores layer_types: a config that
        # carries one means another model (Ministral's interleaved layers).
        "layer_types": Limit(lambda v: v is None, "unset (every layer has the sliding_window)", [FULL, SLIDING]),
    }),
    "Qwen2ForCausalLM": ArchitectureFields(
        _LLAMA_FAMILY | {"use_sliding_window", "max_window_layers"}, _NEUTRAL,
        {**_COMMON_LIMITS, **_QWEN_WINDOWS,
         # q/k/v always have biases and o_proj never, whatever the config says.
         "attention_bias": Limit(_unset, "false (q/k/v always have biases, o_proj none)", True)}),
    "Qwen3ForCausalLM": ArchitectureFields(
        _LLAMA_FAMILY | {"attention_bias", "use_sliding_window", "max_window_layers"}, _NEUTRAL,
        {**_COMMON_LIMITS, **_QWEN_WINDOWS}),
    "DeepseekV2ForCausalLM": ArchitectureFields(_DEEPSEEK | {"topk_method"}, _DEEPSEEK_NEUTRAL, {
        **_DEEPSEEK_LIMITS,
        "norm_topk_prob": Limit(_unset, "false (transformers' V2 router never renormalises)", True),
        "scoring_func": Limit(lambda v: v in (None, "softmax"), "softmax", "sigmoid"),
    }),
    "DeepseekV3ForCausalLM": ArchitectureFields(_DEEPSEEK | {"norm_topk_prob", "rope_interleave"}, _DEEPSEEK_NEUTRAL, {
        **_DEEPSEEK_LIMITS,
        "scoring_func": Limit(lambda v: v in (None, "sigmoid"), "sigmoid", "softmax"),
        "topk_method": Limit(lambda v: v in (None, "noaux_tc"), "noaux_tc", "greedy"),
    }),
}


def _model_name(config, arch: str) -> str:
    path = getattr(config, "_name_or_path", "") or ""
    return f"{arch} ({path})" if path else arch


def check_config(config, arch: str | None = None) -> None:
    """Raise ``ValueError`` naming the model and the field for any config field whose value
    changes the math in a way this architecture's model file does not implement."""
    arch = arch or architecture_of(config)
    fields = ARCHITECTURES.get(arch)
    if fields is None:
        raise ValueError(f"model {arch}: no config checks are registered for this architecture")
    # An alias (transformers' attribute_map: DeepSeek-V3's num_local_experts is n_routed_experts)
    # is checked as the field it names.
    aliases = getattr(type(config), "attribute_map", {}) or {}
    limits = {name: limit for name, limit in FOREIGN.items() if name not in fields.names() and name not in aliases}
    limits.update(fields.limited)
    for name, limit in limits.items():
        # The rope settings as the rotary layer reads them (either transformers spelling).
        value = rope_parameters(config) if name == "rope_parameters" else getattr(config, name, None)
        if not limit.ok(value):
            raise ValueError(f"model {_model_name(config, arch)}: config field {name}={value!r} is not implemented "
                             f"(supported: {limit.supported}); refusing to load rather than serve it wrongly")
    windows = layer_sliding_windows(config, arch)
    if len(windows) != config.num_hidden_layers:
        raise ValueError(f"model {_model_name(config, arch)}: config field layer_types has {len(windows)} entries "
                         f"for {config.num_hidden_layers} layers")


def layer_sliding_windows(config, arch: str | None = None) -> list[int | None]:
    """Each decoder layer's attention window (None: full attention), as transformers applies them:
    Mistral windows every layer by ``sliding_window``; Qwen2/Qwen3 window the layers that
    ``layer_types`` marks ``sliding_attention`` (transformers derives it from
    ``use_sliding_window`` and ``max_window_layers``: layers from ``max_window_layers`` on), and
    only while ``use_sliding_window`` is set."""
    arch = arch or architecture_of(config)
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if arch == "MistralForCausalLM":
        return [window] * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not getattr(config, "use_sliding_window", False) or window is None:
            return [None] * n
        types = getattr(config, "layer_types", None)
        if types is None:
            first = getattr(config, "max_window_layers", 0)
            types = [SLIDING if i >= first else FULL for i in range(n)]
        return [window if t == SLIDING else None for t in types]
    return [None] * n


def kv_sliding_window(config) -> int | None:
    """The window the KV cache may free blocks behind: the largest one when every layer has a
    window, else None. A full-attention layer needs every block of a sequence, and all layers
    share one block table, so a model that mixes them keeps all its blocks (its windowed layers
    still attend within their windows)."""
    windows = layer_sliding_windows(config)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
