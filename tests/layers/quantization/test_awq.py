"""AWQ checkpoints (AutoAWQ's GEMM layout) packed by AutoAWQ's own code: its packer
``WQLinear_GEMM.from_linear`` writes the tensors and its ``dequantize_gemm`` gives the reference
weights, loaded into a plain transformers model. AutoAWQ no longer installs beside current
transformers, so its pure-torch modules are taken from its PyPI wheel (fetched once with pip into
pytest's cache) and imported alone; without them these tests skip."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from quanttest_common import (PROMPTS, assert_load_refused, assert_random_w4a16_weights_at_a_sensible_scale,
                              assert_two_ranks_recombine, base_model, copy_checkpoint, drop_tensor, edit_tensor,
                              float32_llm, greedy_ids, is_layer_projection, linear_layers_and_references,
                              write_checkpoint)
from tests.models.hf_reference import hf_greedy_ids

GROUP = 128
AWQ_WHEEL = "autoawq==0.2.7.post3"
AWQ_MODULES = ("awq/utils/module.py", "awq/utils/utils.py", "awq/utils/packing_utils.py", "awq/modules/linear/gemm.py")
AWQ_CONFIG = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": GROUP, "zero_point": True,
              # substring match, as transformers reads it: layer 1's MLP stays in 32 bits
              "modules_to_not_convert": ["layers.1.mlp"]}


@pytest.fixture(scope="module")
def autoawq(request, tmp_path_factory):
    """AutoAWQ's ``WQLinear_GEMM`` and ``dequantize_gemm``, imported from its wheel without the
    rest of the package (whose ``__init__`` needs an older transformers)."""
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("autoawq-wheel") if cache is not None else tmp_path_factory.mktemp("autoawq-wheel")
    wheels = sorted(str(p) for p in where.glob("autoawq-*.whl"))
    if not wheels:
        got = subprocess.run([sys.executable, "-m", "pip", "download", AWQ_WHEEL, "--no-deps", "--only-binary",
                              ":all:", "-d", str(where)], check=False, capture_output=True, text=True, timeout=300)
        wheels = sorted(str(p) for p in where.glob("autoawq-*.whl"))
        if got.returncode or not wheels:
            pytest.skip(f"AutoAWQ's wheel ({AWQ_WHEEL}) could not be fetched: {got.stderr.strip()[-300:]}")
    root = tmp_path_factory.mktemp("autoawq")
    with zipfile.ZipFile(wheels[0]) as whl:
        for name in AWQ_MODULES:
            whl.extract(name, root)
    for pkg in ("awq", "awq/utils", "awq/modules", "awq/modules/linear"):
        (root / pkg / "__init__.py").touch()
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    sys.path.insert(0, str(root))
    try:
        from awq.modules.linear.gemm import WQLinear_GEMM
        from awq.utils.packing_utils import dequantize_gemm
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return WQLinear_GEMM, dequantize_gemm


def quantize_awq(w: torch.Tensor):
    """Round-to-nearest with a zero point per group, in AWQ's convention (``scale = range / 15``,
    ``zero = -round(min / scale)``): ``(w_q, scales [K/g, N] fp16, zeros [K/g, N])`` with ``w_q``
    exactly ``(q - zero) * scale`` for the fp16 scales."""
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    q = (torch.round(groups / scales) + zeros).clamp(0, 15)
    w_q = ((q - zeros) * scales).reshape(n, k)
    return w_q, scales.squeeze(-1).t().contiguous(), zeros.squeeze(-1).t().contiguous()


def awq_quantized(packer, name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """AutoAWQ's packing (``packer.from_linear``) of the round-to-nearest weight."""
    if not is_layer_projection(name, t) or any(m in name for m in AWQ_CONFIG["modules_to_not_convert"]):
        return None
    w_q, scales, zeros = quantize_awq(t)
    linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False)
    linear.weight.data = w_q
    packed = packer.from_linear(linear, 4, GROUP, scales=scales, zeros=zeros)
    prefix = name.removesuffix("weight")
    return {prefix + key: getattr(packed, key).contiguous() for key in ("qweight", "qzeros", "scales")}


def write_awq_checkpoint(model, packer, path: str, corrupt=None) -> str:
    return write_checkpoint(model, path, AWQ_CONFIG, partial(awq_quantized, packer), corrupt)


@pytest.fixture(scope="module")
def checkpoint(autoawq, tmp_path_factory):
    return write_awq_checkpoint(base_model(), autoawq[0], str(tmp_path_factory.mktemp("awq") / "llama"))


@pytest.fixture(scope="module")
def hf_model(checkpoint, autoawq):
    """A plain transformers model whose linear weights are AutoAWQ's dequantization of the files."""
    dequantize_gemm = autoawq[1]
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    model = base_model(seed=1)  # every weight is overwritten below
    state = {}
    for name in model.state_dict():
        prefix = name.removesuffix("weight")
        if prefix + "qweight" in tensors:
            w = dequantize_gemm(tensors[prefix + "qweight"], tensors[prefix + "qzeros"],
                                tensors[prefix + "scales"].float(), 4, GROUP)  # [K, N]
            state[name] = w.t().contiguous()
        else:
            state[name] = tensors[name]
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return float32_llm(checkpoint)


def test_each_layer_dequantizes_to_autoawqs_reading(llm, hf_model):
    assert llm.engine.runner.model.quantization.describe().startswith("awq")
    for i, proj, layer, ref in linear_layers_and_references(llm, hf_model):
        quantized = i == 0 or proj in ("qkv_proj", "o_proj")  # layer 1's MLP is not converted
        assert layer.quant_method.name == ("awq" if quantized else "unquantized")
        if quantized:
            assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (layer.in_features // 8,
                                                                                  layer.out_features)
        torch.testing.assert_close(layer.quant_method.dequantize(layer), ref, rtol=0, atol=0)


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(llm, hf_model):
    assert greedy_ids(llm, PROMPTS) == hf_greedy_ids(hf_model, PROMPTS, 8)


def test_each_ranks_cut_recombines_into_the_whole_product(checkpoint, hf_model):
    """Layer 0's MLP over two ranks: qweight and qzeros cut by whole words of eight interleaved
    channels (column-parallel), by whole groups along K (row-parallel)."""
    from deepbatch.layers.quantization.awq import AWQConfig

    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    hf = dict(hf_model.named_parameters())
    prefix = "model.layers.0.mlp."
    parts = {p: {key: tensors[f"{prefix}{p}_proj.{key}"] for key in ("qweight", "qzeros", "scales")}
             for p in ("gate", "up", "down")}
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    assert_two_ranks_recombine(AWQConfig.from_hf(AWQ_CONFIG), parts,
                               {p: hf[f"{prefix}{p}_proj.weight"] for p in ("gate", "up", "down")}, x)


def _halve(name):
    return edit_tensor(name, lambda t: t[:, : t.shape[1] // 2])


@pytest.mark.parametrize("corrupt, message", [
    (drop_tensor("model.layers.0.self_attn.o_proj.scales"), "o_proj.scales"),
    (drop_tensor("model.layers.0.mlp.down_proj.qzeros"), "down_proj.qzeros"),
    (_halve("model.layers.0.self_attn.k_proj.qweight"), "shape"),
    (_halve("model.layers.0.mlp.up_proj.scales"), "shape"),
], ids=["missing-scales", "missing-qzeros", "wrong-qweight-shape", "wrong-scales-shape"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, autoawq, corrupt, message):
    assert_load_refused(write_awq_checkpoint(base_model(), autoawq[0], str(tmp_path / "bad"), corrupt=corrupt),
                        message)


@pytest.mark.parametrize("change, message", [
    ({"version": "gemv"}, "version 'gemv'"),
    ({"version": "exllama"}, "version 'exllama'"),
    ({"bits": 8}, "bits 8"),
    ({"group_size": -1}, "group_size -1"),
    ({"group_size": 96}, "group_size 96 does not divide"),  # a multiple of 8 that does not divide K = 256
    ({"zero_point": False}, "zero_point"),
    ({"something_new": 1}, "something_new"),
], ids=["gemv", "exllama", "8-bit", "per-channel", "group-not-dividing-k", "no-zero-point", "unknown-option"])
def test_unsupported_configs_are_refused_naming_the_option(tmp_path, checkpoint, change, message):
    assert_load_refused(copy_checkpoint(checkpoint, str(tmp_path / "ckpt"), qc={**AWQ_CONFIG, **change}), message)


def test_a_merged_layer_ignored_in_part_is_refused():
    from deepbatch.layers.quantization.awq import AWQConfig

    config = AWQConfig.from_hf({**AWQ_CONFIG, "modules_to_not_convert": ["self_attn.k_proj"]})
    assert not config.is_ignored("model.layers.0.mlp.gate_up_proj")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj"):
        config.is_ignored("model.layers.0.self_attn.qkv_proj")
    assert AWQConfig.from_hf({**AWQ_CONFIG, "modules_to_not_convert": ["self_attn"]}).is_ignored(
        "model.layers.0.self_attn.qkv_proj")


def test_random_weights_fill_the_checkpoint_tensors_at_a_sensible_scale(tmp_path):
    assert_random_w4a16_weights_at_a_sensible_scale(tmp_path, AWQ_CONFIG)
