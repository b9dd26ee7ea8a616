"""AWQ checkpoints (AutoAWQ's GEMM layout) packed by AutoAWQ's own code: its packer
``WQLinear_GEMM.from_linear`` writes the tensors and its ``dequantize_gemm`` gives the reference
weights, loaded into a plain transformers model. AutoAWQ no longer installs beside current
transformers, so its pure-torch modules are taken from its PyPI wheel (fetched once with pip into
pytest's cache) and imported alone; without them these tests skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepbatch import LLM, SamplingParams
from tests.models.hf_reference import hf_greedy_ids

GROUP = 128
AWQ_WHEEL = "autoawq==0.2.7.post3"
AWQ_MODULES = ("awq/utils/module.py", "awq/utils/utils.py", "awq/utils/packing_utils.py", "awq/modules/linear/gemm.py")
AWQ_CONFIG = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": GROUP, "zero_point": True,
              # substring match, as transformers reads it: layer 1's MLP stays in 32 bits
              "modules_to_not_convert": ["layers.1.mlp"]}
PROMPTS = [[5, 17, 99, 3, 250, 31], [1, 2, 3], [300, 12, 7, 7, 7, 44, 90, 18, 201, 6, 66], [7, 8, 9, 10, 11],
           [200, 100, 50, 25]]


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.08, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


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


def is_awq_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("proj.weight") and not any(
        m in name for m in AWQ_CONFIG["modules_to_not_convert"])


def write_awq_checkpoint(model, packer, path: str, qc: dict = AWQ_CONFIG, corrupt=None) -> str:
    tensors = {}
    for name, t in model.state_dict().items():
        if not is_awq_linear(name):
            tensors[name] = t.contiguous()
            continue
        w_q, scales, zeros = quantize_awq(t)
        linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False)
        linear.weight.data = w_q
        packed = packer.from_linear(linear, 4, GROUP, scales=scales, zeros=zeros)
        prefix = name.removesuffix("weight")
        for key in ("qweight", "qzeros", "scales"):
            tensors[prefix + key] = getattr(packed, key).contiguous()
    if corrupt:
        corrupt(tensors)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def base_model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()


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
    return LLM(checkpoint, dtype="float32", device="cpu", max_model_len=128)


def test_each_layer_dequantizes_to_autoawqs_reading(llm, hf_model):
    ours = llm.engine.runner.model
    hf = dict(hf_model.named_parameters())
    assert ours.quantization.describe().startswith("awq")
    for i in range(2):
        attn, mlp = ours.model.layers[i].self_attn, ours.model.layers[i].mlp
        qkv = torch.cat([hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([hf[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for layer, ref in ((attn.qkv_proj, qkv), (attn.o_proj, hf[f"model.layers.{i}.self_attn.o_proj.weight"]),
                           (mlp.gate_up_proj, gate_up), (mlp.down_proj, hf[f"model.layers.{i}.mlp.down_proj.weight"])):
            quantized = i == 0 or layer in (attn.qkv_proj, attn.o_proj)  # layer 1's MLP is not converted
            assert layer.quant_method.name == ("awq" if quantized else "unquantized")
            if quantized:
                assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (layer.in_features // 8,
                                                                                      layer.out_features)
            torch.testing.assert_close(layer.quant_method.dequantize(layer), ref, rtol=0, atol=0)


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(llm, hf_model):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_ids(hf_model, PROMPTS, 8)


def test_each_ranks_cut_recombines_into_the_whole_product(checkpoint, hf_model):
    """Two tensor-parallel ranks simulated in one process on layer 0's MLP: gate|up column-parallel
    (qweight and qzeros cut by whole words of eight interleaved channels), down row-parallel (cut
    along K by whole groups); outputs concatenate per part and partial products sum."""
    from deepbatch.distributed.parallel_state import TensorParallelGroup, building_for
    from deepbatch.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from deepbatch.layers.quantization import quantization_scope
    from deepbatch.layers.quantization.awq import AWQConfig

    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    hf = dict(hf_model.named_parameters())
    prefix = "model.layers.0.mlp."
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    gate, up = (x @ hf[f"{prefix}{p}_proj.weight"].t() for p in ("gate", "up"))
    y_ref = gate @ hf[f"{prefix}down_proj.weight"].t()
    config = AWQConfig.from_hf(AWQ_CONFIG)
    partial = []
    for rank in range(2):
        with building_for(TensorParallelGroup(rank, 2)), quantization_scope(config):
            gate_up = MergedColumnParallelLinear(256, [512, 512])
            down = RowParallelLinear(512, 256, reduce_results=False)
        for key in ("qweight", "qzeros", "scales"):
            for shard, p in enumerate(("gate", "up")):
                gate_up.weight_loader(getattr(gate_up, key), tensors[f"{prefix}{p}_proj.{key}"], shard)
            down.weight_loader(getattr(down, key), tensors[f"{prefix}down_proj.{key}"])
        gate_up.process_weights_after_loading()
        down.process_weights_after_loading()
        rows = slice(256 * rank, 256 * (rank + 1))
        torch.testing.assert_close(gate_up(x), torch.cat([gate[:, rows], up[:, rows]], -1))
        partial.append(down(gate[:, rows]))
    torch.testing.assert_close(sum(partial), y_ref)


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _halve(name):
    def corrupt(tensors):
        tensors[name] = tensors[name][:, : tensors[name].shape[1] // 2].contiguous()
    return corrupt


@pytest.mark.parametrize("corrupt, message", [
    (_drop("model.layers.0.self_attn.o_proj.scales"), "o_proj.scales"),
    (_drop("model.layers.0.mlp.down_proj.qzeros"), "down_proj.qzeros"),
    (_halve("model.layers.0.self_attn.k_proj.qweight"), "shape"),
    (_halve("model.layers.0.mlp.up_proj.scales"), "shape"),
], ids=["missing-scales", "missing-qzeros", "wrong-qweight-shape", "wrong-scales-shape"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, autoawq, corrupt, message):
    path = write_awq_checkpoint(base_model(), autoawq[0], str(tmp_path / "bad"), corrupt=corrupt)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


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
    path = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {**AWQ_CONFIG, **change}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


def test_a_merged_layer_ignored_in_part_is_refused():
    from deepbatch.layers.quantization.awq import AWQConfig

    config = AWQConfig.from_hf({**AWQ_CONFIG, "modules_to_not_convert": ["self_attn.k_proj"]})
    assert not config.is_ignored("model.layers.0.mlp.gate_up_proj")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj"):
        config.is_ignored("model.layers.0.self_attn.qkv_proj")
    assert AWQConfig.from_hf({**AWQ_CONFIG, "modules_to_not_convert": ["self_attn"]}).is_ignored(
        "model.layers.0.self_attn.qkv_proj")


def test_random_weights_fill_the_checkpoint_tensors_at_a_sensible_scale(tmp_path):
    """A bare config.json (benchmarks): the format's own tensors are filled directly, then
    converted like a checkpoint's; what they hold is the bits per weight the roofline counts."""
    cfg = llama_config().to_dict()
    cfg["quantization_config"] = AWQ_CONFIG
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path / "config.json"), dtype="bfloat16", device="cpu", max_model_len=128)
    for layer in (llm.engine.runner.model.model.layers[0].self_attn.qkv_proj,
                  llm.engine.runner.model.model.layers[0].mlp.down_proj):
        assert sorted(n for n, _ in layer.named_parameters()) == ["qweight", "scales", "zeros"]
        assert torch.equal(layer.zeros, torch.full_like(layer.zeros, 8.0))
        assert 0.015 < float(layer.quant_method.dequantize(layer).float().std()) < 0.025
        stored = sum(p.numel() * p.element_size() * 8 for p in layer.parameters())
        assert stored / (layer.in_features * layer.out_features) == llm.engine.runner.model.quantization.weight_bits()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
