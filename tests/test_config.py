"""The config dataclasses declare every field (an engine argument with its help text, or
internal), and the choices they declare are what each config accepts."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from deepbatch.config import (QUANTIZATION_METHODS, CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                              SchedulerConfig)
from deepbatch.kernels import kv_quant

CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig)


def model(**kw) -> ModelConfig:
    return ModelConfig(None, torch.float32, None, **kw)


def engine(**kw) -> EngineConfig:
    return EngineConfig(model(), CacheConfig(), SchedulerConfig(), **kw)


def test_every_field_is_declared_with_its_help():
    for cls in CONFIGS:
        for f in fields(cls):
            if f.name in ("model", "cache", "scheduler", "parallel") and cls is EngineConfig:
                continue  # the nested configs, declared field by field themselves
            spec = f.metadata.get("arg")
            assert spec is not None, f"{cls.__name__}.{f.name}"
            assert spec.help.strip(), f"{cls.__name__}.{f.name} has no help text"


# Every field with choices, as the CLI and the engine know them (deepbatch/kernels/kv_quant.py,
# layers/quantization, the scheduler's policies and the runner's modes).
CHOICES = {
    (ModelConfig, "quantization"): ("quantization", QUANTIZATION_METHODS),
    (CacheConfig, "kv_cache_dtype"): ("kv_cache_dtype", kv_quant.KV_CACHE_DTYPES),
    (SchedulerConfig, "policy"): ("scheduling_policy", ("fcfs", "priority", "fair")),
    (SchedulerConfig, "admission"): ("admission", ("greedy", "predictive")),
    (SchedulerConfig, "preemption_mode"): ("preemption_mode", ("auto", "swap", "recompute")),
    (EngineConfig, "attention_backend"): ("attention_backend", ("auto", "torch", "triton")),
    (EngineConfig, "cuda_graph_mode"): ("cuda_graph_mode", ("full", "decode")),
    (ModelConfig, "mla_prefill"): ("mla_prefill", ("absorbed", "expanded")),
}
BUILD = {ModelConfig: model, CacheConfig: CacheConfig, SchedulerConfig: SchedulerConfig, EngineConfig: engine}


def test_declared_choices_are_what_each_config_accepts():
    declared = {(cls, f.name): f.metadata["arg"].choices for cls in CONFIGS for f in fields(cls)
                if "arg" in f.metadata and f.metadata["arg"].choices}
    assert declared == {key: tuple(choices) for key, (_, choices) in CHOICES.items()}
    for (cls, field_name), (name, choices) in CHOICES.items():
        for choice in choices:
            assert getattr(BUILD[cls](**{field_name: choice}), field_name) == choice
        with pytest.raises(ValueError) as e:
            BUILD[cls](**{field_name: "bogus"})
        assert str(e.value) == f"{name}: must be one of {', '.join(choices)}; got 'bogus'"


def test_none_is_a_choice_only_where_the_field_may_be_none():
    assert model(quantization=None).quantization is None
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        CacheConfig(kv_cache_dtype=None)
    with pytest.raises(ValueError, match="scheduling_policy: must be one of"):
        SchedulerConfig(policy=None)
