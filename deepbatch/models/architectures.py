"""Which architecture a config names: ``config.architectures[0]``, or the architecture its
``model_type`` stands for (GGUF files and hand-written configs carry only the latter)."""

from __future__ import annotations

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def model_types() -> dict[str, str]:
    """transformers ``model_type`` -> the architecture it names."""
    return dict(_MODEL_TYPES)


def architecture_of(config) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"model: cannot tell the architecture of a config with model_type {model_type!r}")
