"""Config fields a model file does not implement are refused at load, naming the model and the
field; none is served in silence.

The walk: for every registered architecture, every field of its transformers config class must
be named implemented, neutral or limited by ``models/config_checks.py``, so a field transformers
adds fails here until someone decides what it means for deepbatch. Each limited field, and each
other family's math field (soft-capping, multipliers, chunked attention, ...), set to a value
deepbatch does not implement, must stop the load."""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import pytest

from deepbatch.models.config_checks import (
    ARCHITECTURES,
    FOREIGN,
    check_config,
    kv_sliding_window,
    layer_sliding_windows,
)
from deepbatch.models.registry import get_model_class, model_types, supported_architectures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_class(arch: str):
    from transformers import CONFIG_MAPPING

    model_type = next(t for t, a in model_types().items() if a == arch)
    return CONFIG_MAPPING[model_type]


def default_config(arch: str):
    config = config_class(arch)()
    config.architectures = [arch]
    return config


def test_every_registered_architecture_has_checks():
    assert set(supported_architectures()) == set(ARCHITECTURES)
    assert set(model_types().values()) == set(supported_architectures())


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_field_of_the_config_class_is_classified(arch):
    from transformers import PretrainedConfig

    base = set(PretrainedConfig().to_dict())
    fields = set(config_class(arch)().to_dict()) - base
    unclassified = fields - ARCHITECTURES[arch].names()
    assert not unclassified, f"{arch}: decide whether these change the math and whether deepbatch implements them"


@pytest.mark.parametrize("arch", supported_architectures())
def test_the_default_config_loads(arch):
    check_config(default_config(arch))


def refusal_cases():
    for arch in supported_architectures():
        named = ARCHITECTURES[arch].names()
        for name, limit in ARCHITECTURES[arch].limited.items():
            yield pytest.param(arch, name, limit.refused_example, id=f"{arch}-{name}")
        for name, limit in FOREIGN.items():
            if name not in named and name not in getattr(config_class(arch), "attribute_map", {}):
                yield pytest.param(arch, name, limit.refused_example, id=f"{arch}-foreign-{name}")


@pytest.mark.parametrize("arch, name, value", list(refusal_cases()))
def test_an_unimplemented_value_is_refused_naming_model_and_field(arch, name, value):
    config = default_config(arch)
    setattr(config, name, value)
    with pytest.raises(ValueError, match=rf"model {arch}.*config field {name}=.*not implemented"):
        get_model_class(config)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_types_that_change_with_length_are_refused(arch, rope_type):
    config = default_config(arch)
    config.rope_parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_parameters"):
        check_config(config)
    for ok in ("default", "linear", "llama3", "yarn"):
        config.rope_parameters = {"rope_type": ok, "factor": 2.0, "rope_theta": 10000.0}
        check_config(config)
    # A transformers v4 object that carries only rope_scaling is read the way the rotary layer reads it.
    v4 = SimpleNamespace(**{k: getattr(config, k) for k in ("num_hidden_layers", "architectures")},
                         hidden_act="silu", rope_scaling={"type": rope_type, "factor": 2.0}, rope_theta=10000.0)
    with pytest.raises(ValueError, match="rope_parameters"):
        check_config(v4)


def test_layer_types_of_the_wrong_length_are_refused():
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                         architectures=["Qwen2ForCausalLM"])
    config.layer_types = ["sliding_attention"] * 3
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        check_config(config)


def test_qwen2_windows_follow_transformers():
    from transformers import Qwen2Config

    for use, first in ((True, 2), (True, 0), (False, 2)):
        hf = Qwen2Config(num_hidden_layers=4, use_sliding_window=use, sliding_window=64, max_window_layers=first,
                         architectures=["Qwen2ForCausalLM"])
        want = [64 if t == "sliding_attention" else None for t in hf.layer_types]
        assert layer_sliding_windows(hf) == want
        # A config object without layer_types (an older transformers): derived the same way.
        bare = SimpleNamespace(num_hidden_layers=4, use_sliding_window=use, sliding_window=64, max_window_layers=first,
                               architectures=["Qwen2ForCausalLM"])
        assert layer_sliding_windows(bare) == want
    assert kv_sliding_window(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                         max_window_layers=0, architectures=["Qwen2ForCausalLM"])) == 64
    assert kv_sliding_window(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                         max_window_layers=2, architectures=["Qwen2ForCausalLM"])) is None


def test_mistral_windows_every_layer_and_llama_none():
    from transformers import LlamaConfig, MistralConfig

    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=32,
                                               architectures=["MistralForCausalLM"])) == [32] * 3
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=None,
                                               architectures=["MistralForCausalLM"])) == [None] * 3
    assert kv_sliding_window(LlamaConfig(num_hidden_layers=3, architectures=["LlamaForCausalLM"])) is None


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "benchmarks", "models", "*.json"))),
                         ids=os.path.basename)
def test_benchmark_model_configs_load(path):
    from transformers import AutoConfig

    with open(path) as f:
        get_model_class(AutoConfig.for_model(**json.load(f)))


@pytest.mark.parametrize("changes, field", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(sliding_window=16), "sliding_window"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
])
def test_loading_a_checkpoint_with_an_unimplemented_field_fails_before_any_weight(tmp_path, changes, field):
    """Only config.json: a load that read weights first would fail on the missing safetensors."""
    from transformers import LlamaConfig

    from deepbatch import LLM

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    for k, v in changes.items():
        setattr(config, k, v)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"model LlamaForCausalLM \({tmp_path}\): config field {field}="):
        LLM(str(tmp_path), dtype="float32", device="cpu")


def test_a_mistral_config_that_interleaves_layers_is_refused(tmp_path):
    from transformers import MistralConfig

    from deepbatch import LLM

    config = MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                           architectures=["MistralForCausalLM"])
    config.layer_types = ["sliding_attention", "full_attention"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="MistralForCausalLM.*layer_types"):
        LLM(str(tmp_path), dtype="float32", device="cpu")


def test_qwen2_has_qkv_biases_and_refuses_attention_bias():
    """transformers' Qwen2 has q/k/v biases and no o_proj bias whatever attention_bias says; a
    config that sets it is refused rather than built with an o_proj bias."""
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=2, architectures=["Qwen2ForCausalLM"])
    config.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        get_model_class(config)
    config.attention_bias = False
    model = get_model_class(config)(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                architectures=["Qwen2ForCausalLM"]), max_position=16)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
