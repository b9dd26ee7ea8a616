"""Architecture name (``config.architectures[0]``) -> model class."""

from __future__ import annotations

import importlib

from deepbatch.models.architectures import architecture_of, model_types  # noqa: F401 - model_types: this module's API
from deepbatch.models.config_checks import check_config

_MODELS = {
    "LlamaForCausalLM": ("deepbatch.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("deepbatch.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("deepbatch.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("deepbatch.models.llama", "Qwen3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepbatch.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepbatch.models.deepseek_v2", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config):
    """The model class for ``config``, after refusing any config field its model file does not
    implement (``models/config_checks.py``): a model is never built to be served wrongly."""
    arch = architecture_of(config)
    if arch not in _MODELS:
        raise ValueError(f"model: architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}")
    check_config(config, arch)
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(module), name)
