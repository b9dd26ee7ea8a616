"""Architecture name (``config.architectures[0]``) -> model class."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("deepbatch.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("deepbatch.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("deepbatch.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("deepbatch.models.llama", "Qwen3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepbatch.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepbatch.models.deepseek_v2", "DeepseekV3ForCausalLM"),
}

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


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


def get_model_class(config):
    """The model class for ``config``, after refusing any config field its model file does not
    implement (``models/config_checks.py``): a model is never built to be served wrongly."""
    from deepbatch.models.config_checks import check_config

    arch = architecture_of(config)
    if arch not in _MODELS:
        raise ValueError(f"model: architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}")
    check_config(config, arch)
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(module), name)
