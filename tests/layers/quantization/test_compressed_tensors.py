"""compressed-tensors checkpoints made by llm-compressor (``oneshot`` with a ``QuantizationModifier``:
W4A16, W4A16_ASYM and FP8_DYNAMIC, saved compressed), held to transformers loading the same files
and decompressing them with the compressed-tensors package, in float32. Every layer's weight
equal; W4A16: greedy tokens identical; FP8_DYNAMIC: both round the activations to e4m3 per token at
run time, so the logits are held to a stated tolerance."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from deepbatch import LLM
from quanttest_common import (PROMPTS, assert_load_refused, assert_random_w4a16_weights_at_a_sensible_scale,
                              base_model, copy_checkpoint, drop_tensor, edit_tensor, float32_llm, greedy_ids,
                              last_logprobs, linear_layers_and_references, next_token_gaps, quantization_config_of)
from tests.models.hf_reference import hf_greedy_ids

pytest.importorskip("compressed_tensors")

# name: (llm-compressor preset, ignore); the asymmetric one also leaves layer 1's MLP in 32 bits,
# through a `re:` pattern that names its projections one by one.
SCHEMES = {
    "w4a16": ("W4A16", ["lm_head"]),
    "w4a16-asym": ("W4A16_ASYM", ["lm_head", r"re:.*layers\.1\.mlp\.(gate|up|down)_proj$"]),
    "fp8-dynamic": ("FP8_DYNAMIC", ["lm_head"]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("compressed-tensors")
    # oneshot reads the model's config back from its directory: quantize a saved model.
    base_model().save_pretrained(root / "base")
    paths = {}
    for name, (scheme, ignore) in SCHEMES.items():
        model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore))
        model.save_pretrained(root / name, save_compressed=True)
        paths[name] = str(root / name)
    return paths


_hf_models: dict[str, torch.nn.Module] = {}
_llms: dict[str, LLM] = {}


def hf_model(path: str):
    """transformers on the compressed files, decompressed to float32 by compressed-tensors."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    if path not in _hf_models:
        _hf_models[path] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    return _hf_models[path]


def deepbatch_llm(path: str) -> LLM:
    if path not in _llms:
        _llms[path] = float32_llm(path)
    return _llms[path]


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "fp8-dynamic"])
def test_each_layer_dequantizes_to_what_the_package_decompresses(checkpoints, name):
    llm = deepbatch_llm(checkpoints[name])
    expected = {"w4a16": "compressed-tensors-w4a16", "w4a16-asym": "compressed-tensors-w4a16",
                "fp8-dynamic": "fp8-channel"}[name]
    pairs = linear_layers_and_references(llm, hf_model(checkpoints[name]))
    assert len(pairs) == 8
    for i, proj, layer, ref in pairs:
        ignored = name == "w4a16-asym" and i == 1 and proj in ("gate_up_proj", "down_proj")
        assert layer.quant_method.name == ("unquantized" if ignored else expected), (i, proj)
        torch.testing.assert_close(layer.quant_method.dequantize(layer).float(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
def test_w4a16_greedy_tokens_match_transformers(checkpoints, name):
    want = hf_greedy_ids(hf_model(checkpoints[name]), PROMPTS, 8)
    assert greedy_ids(deepbatch_llm(checkpoints[name]), PROMPTS) == want


def unrounded_model(hf):
    """A plain transformers model on the same (dequantized) weights, its activations not rounded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    model.load_state_dict({k: v for k, v in hf.state_dict().items()
                           if not k.endswith(("weight_scale", "weight_shape", "weight_zero_point"))})
    return model


def test_fp8_dynamic_logits_match_transformers_rounding_activations_per_token(checkpoints):
    """transformers' compressed-tensors model rounds each linear input to e4m3 per token at run
    time too, so both sides round the same activations: equal but for an activation whose float32
    value differs in the last bits between the two and so lands on the neighbouring e4m3 value
    (hundredths of a unit of log-probability at most). Against a model that does not round its
    activations: the rounding itself (3 mantissa bits), tenths of a unit on this random model."""
    hf = hf_model(checkpoints["fp8-dynamic"])
    worst_same, worst_plain = next_token_gaps(deepbatch_llm(checkpoints["fp8-dynamic"]), PROMPTS,
                                              [partial(last_logprobs, hf), partial(last_logprobs, unrounded_model(hf))])
    assert worst_same < 0.05, worst_same
    assert worst_same < worst_plain / 5, (worst_same, worst_plain)


def test_the_packed_layout_is_the_canonical_one_transposed():
    """What the loader relies on to skip unpacking ``weight_packed``: the package's 4-bit packing
    along K, stored ``q + 8``, is ``w4a16_gemm``'s nibble order on the transposed matrix."""
    from compressed_tensors.compressors import pack_to_int32, unpack_from_int32

    from deepbatch.kernels.w4a16_gemm import pack_int4

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (24, 64), generator=gen, dtype=torch.int8)  # [N, K], signed as the package stores
    packed = pack_to_int32(q, 4)
    assert torch.equal(packed.t(), pack_int4((q.to(torch.int32) + 8).t()))
    zp_packed = pack_to_int32(q, 4, packed_dim=0)  # zero points: packed along N
    assert torch.equal(unpack_from_int32(zp_packed, 4, q.shape, packed_dim=0), q)


@pytest.mark.parametrize("name, corrupt, message", [
    ("w4a16", drop_tensor("model.layers.1.self_attn.o_proj.weight_scale"), "o_proj.weight_scale"),
    ("w4a16", drop_tensor("model.layers.0.mlp.up_proj.weight_packed"),
     r"part\(s\) \[1\] of model.layers.0.mlp.gate_up_proj"),
    ("w4a16-asym", drop_tensor("model.layers.0.self_attn.o_proj.weight_zero_point"), "o_proj.weight_zero_point"),
    ("w4a16-asym", edit_tensor("model.layers.0.self_attn.v_proj.weight_zero_point", lambda t: t[:, :1]), "shape"),
    ("w4a16", edit_tensor("model.layers.0.self_attn.q_proj.weight_packed", lambda t: t[:, :16]), "shape"),
    ("w4a16", edit_tensor("model.layers.0.mlp.down_proj.weight_shape", lambda t: t.flip(0)), "weight_shape"),
], ids=["missing-scale", "missing-part", "missing-zero-point", "wrong-zero-point-shape", "wrong-packed-shape",
        "wrong-weight-shape"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, checkpoints, name, corrupt, message):
    assert_load_refused(copy_checkpoint(checkpoints[name], str(tmp_path / "bad"), corrupt=corrupt), message)


def _weights(**change):
    def edit(qc):
        qc["config_groups"]["group_0"]["weights"].update(change)
        return qc
    return edit


def _inputs(**change):
    def edit(qc):
        qc["config_groups"]["group_0"]["input_activations"].update(change)
        return qc
    return edit


def _top(**change):
    return lambda qc: {**qc, **change}


def _group(**change):
    def edit(qc):
        qc["config_groups"]["group_0"].update(change)
        return qc
    return edit


def _two_groups(qc):
    qc["config_groups"]["group_1"] = qc["config_groups"]["group_0"]
    return qc


@pytest.mark.parametrize("name, edit, message", [
    ("w4a16", _weights(num_bits=8), "num_bits 8"),
    ("w4a16", _weights(strategy="channel", group_size=-1), "strategy 'channel'"),
    ("w4a16", _weights(group_size=96), "group_size 96 does not divide"),  # a multiple of 8 that does not divide 256
    ("w4a16", _weights(group_size=100), "group_size 100"),
    ("w4a16", _weights(something_new=1), "something_new"),
    ("w4a16", _group(targets=["re:.*proj$"]), "targets"),
    ("w4a16", _group(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "input_activations"),
    ("w4a16", _two_groups, "2 config_groups"),
    ("w4a16", _group(format="marlin-24"), "format 'marlin-24'"),
    ("w4a16", _top(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    ("w4a16", _top(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    ("w4a16", _top(quantization_status="frozen"), "quantization_status 'frozen'"),
    ("w4a16", _top(something_new=1), "something_new"),
    ("fp8-dynamic", _inputs(dynamic=False, strategy="tensor"), "input_activations strategy 'tensor'"),
    ("fp8-dynamic", _weights(strategy="tensor"), "weights strategy 'tensor'"),
    ("fp8-dynamic", _group(input_activations=None), "input_activations"),
], ids=["8-bit", "channel", "group-not-dividing-k", "group-not-multiple-of-8", "unknown-weights-option",
        "regex-targets", "w4a8", "two-groups", "marlin-24", "kv-cache-scheme", "sparsity", "not-compressed",
        "unknown-option", "fp8-static-activations", "fp8-per-tensor-weights", "fp8-weight-only"])
def test_unsupported_configs_are_refused_naming_the_option(tmp_path, checkpoints, name, edit, message):
    qc = edit(quantization_config_of(checkpoints[name]))
    assert_load_refused(copy_checkpoint(checkpoints[name], str(tmp_path / "ckpt"), qc=qc), message)


def test_ignore_matches_checkpoint_names_and_refuses_a_merged_layer_split(checkpoints):
    from deepbatch.layers.quantization.compressed_tensors import CompressedTensorsConfig

    qc = quantization_config_of(checkpoints["w4a16"])
    config = CompressedTensorsConfig.from_hf({**qc, "ignore": ["model.layers.0.self_attn.q_proj",
                                                               r"re:.*\.(k|v)_proj$", "re:.*layers.1.mlp.gate"]})
    assert config.is_ignored("model.layers.0.self_attn.qkv_proj")
    assert not config.is_ignored("model.layers.0.self_attn.o_proj")
    assert not config.is_ignored("model.layers.0.mlp.gate_up_proj")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj"):
        config.is_ignored("model.layers.1.mlp.gate_up_proj")  # gate ignored, up quantized: one layer cannot


def test_without_the_package_the_error_says_what_to_install(checkpoints, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "compressed_tensors.quantization", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'deepbatch\[quant\]'"):
        float32_llm(checkpoints["w4a16"])


def test_random_weights_fill_the_checkpoint_tensors_at_a_sensible_scale(tmp_path, checkpoints):
    assert_random_w4a16_weights_at_a_sensible_scale(tmp_path, quantization_config_of(checkpoints["w4a16-asym"]))
