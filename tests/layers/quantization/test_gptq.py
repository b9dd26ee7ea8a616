"""GPTQ checkpoints (4-bit, symmetric, ``checkpoint_format: "gptq"``). transformers reads GPTQ only
through optimum/GPTQModel on a GPU, so the checkpoint is written by a packer in this file, itself
checked bit for bit against the documented layout decoded by a plain-Python loop (qweight packed
along K and qzeros along N, nibble i of a word at bits 4i..4i+3, zero points stored minus one);
the reference is a transformers model on the weights ``(q - 8) * scale`` computed here from the
unpacked integers, never through deepbatch. Tensor parallelism: each rank's cut of the packed
tensors, simulated in one process, and a real TP=2 run over gloo."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from deepbatch import LLM, SamplingParams
from deepbatch.distributed.parallel_state import TensorParallelGroup, building_for
from deepbatch.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from deepbatch.layers.quantization import quantization_scope
from tests.models.hf_reference import hf_greedy_ids

GROUP = 128
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
               "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq"}
PROMPTS = [[5, 17, 99, 3, 250, 31], [1, 2, 3], [300, 12, 7, 7, 7, 44, 90, 18, 201, 6, 66], [7, 8, 9, 10, 11],
           [200, 100, 50, 25]]


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.08, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def pack_nibbles(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 0..15 values per int32 along ``dim``, value i of each eight at bits 4i..4i+3."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8) << (4 * torch.arange(8))
    words = v.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def quantize_gptq(w: torch.Tensor, group: int | None = GROUP):
    """Symmetric round-to-nearest per group (GPTQ's grid, without its error feedback, which does
    not change the format): ``(q [K, N] in 0..15, scales [K/g, N] fp16)``, ``W = (q - 8) * scale``."""
    n, k = w.shape
    g = group or k
    groups = w.t().reshape(k // g, g, n)
    scales = (2 * groups.abs().amax(1) / 15).clamp(min=1e-6).half()  # [K/g, N]
    q = (torch.round(groups / scales.float()[:, None]) + 8).clamp(0, 15).reshape(k, n).to(torch.int32)
    return q, scales


def gptq_tensors(w: torch.Tensor, group: int | None = GROUP) -> dict[str, torch.Tensor]:
    q, scales = quantize_gptq(w, group)
    k, n = q.shape
    return {"qweight": pack_nibbles(q, 0), "qzeros": pack_nibbles(torch.full((k // (group or k), n), 8 - 1), 1),
            "scales": scales, "g_idx": torch.arange(k, dtype=torch.int32) // (group or k)}


def dequantized(tensors: dict[str, torch.Tensor], group: int | None = GROUP) -> torch.Tensor:
    """``[N, K]`` float32 from the test's own unpacking of ``qweight`` (zero point 8, symmetric)."""
    words = tensors["qweight"].to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], 1).reshape(-1, words.shape[1])  # [K, N]
    k = q.shape[0]
    scales = tensors["scales"].float().repeat_interleave(group or k, 0)
    return ((q.float() - 8) * scales).t().contiguous()


def test_the_packer_follows_the_documented_layout():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 24), generator=gen)
    along_k, along_n = pack_nibbles(q, 0), pack_nibbles(q, 1)
    assert along_k.shape == (4, 24) and along_n.shape == (32, 3)
    for r in range(32):
        for c in range(24):
            word_k = int(along_k[r // 8, c]) & 0xFFFFFFFF
            word_n = int(along_n[r, c // 8]) & 0xFFFFFFFF
            assert (word_k >> (4 * (r % 8))) & 0xF == int(q[r, c])
            assert (word_n >> (4 * (c % 8))) & 0xF == int(q[r, c])


def write_checkpoint(model, path: str, qc: dict = GPTQ_CONFIG, corrupt=None) -> str:
    tensors = {}
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            for key, value in gptq_tensors(t).items():
                tensors[name.removesuffix("weight") + key] = value
        else:
            tensors[name] = t.contiguous()
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
def checkpoint(tmp_path_factory):
    return write_checkpoint(base_model(), str(tmp_path_factory.mktemp("gptq") / "llama"))


@pytest.fixture(scope="module")
def hf_model():
    model = base_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                p.copy_(dequantized(gptq_tensors(p.data)))
    return model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", max_model_len=128)


def greedy(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_each_layer_dequantizes_to_the_packed_weights(llm, hf_model):
    ours = llm.engine.runner.model
    hf = dict(hf_model.named_parameters())
    assert ours.quantization.describe().startswith("gptq")
    for i in range(2):
        attn, mlp = ours.model.layers[i].self_attn, ours.model.layers[i].mlp
        qkv = torch.cat([hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([hf[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for layer, ref in ((attn.qkv_proj, qkv), (attn.o_proj, hf[f"model.layers.{i}.self_attn.o_proj.weight"]),
                           (mlp.gate_up_proj, gate_up), (mlp.down_proj, hf[f"model.layers.{i}.mlp.down_proj.weight"])):
            assert layer.quant_method.name == "gptq"
            torch.testing.assert_close(layer.quant_method.dequantize(layer), ref, rtol=0, atol=0)


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(llm, hf_model):
    assert greedy(llm) == hf_greedy_ids(hf_model, PROMPTS, 8)


def test_tensor_parallel_two_ranks_over_gloo(checkpoint, hf_model):
    """Column-parallel layers cut qweight, scales and qzeros along N (qzeros by whole words),
    row-parallel ones along K (qweight by words of eight rows, scales and qzeros by groups)."""
    tp2 = LLM(checkpoint, dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2,
              distributed_timeout_s=30)
    try:
        layer = tp2.engine.runner.model.model.layers[0]  # rank 0's half of each layer
        assert layer.self_attn.qkv_proj.zeros.shape == (256 // GROUP, (256 + 2 * 128) // 2)
        assert layer.mlp.down_proj.qweight.shape == (512 // 2 // 8, 256)
        assert layer.mlp.down_proj.scales.shape == (512 // 2 // GROUP, 256)
        assert greedy(tp2) == hf_greedy_ids(hf_model, PROMPTS, 8)
    finally:
        tp2.engine.shutdown()


@pytest.mark.parametrize("group", [GROUP, None], ids=["group-128", "one-group-per-channel"])
def test_each_ranks_cut_recombines_into_the_whole_product(group):
    """Two ranks simulated in one process: gate|up column-parallel (outputs concatenate per part),
    down row-parallel (partial products sum); ``group_size: -1`` keeps its one scale row whole."""
    from deepbatch.layers.quantization.gptq import GPTQConfig

    torch.manual_seed(0)
    config = GPTQConfig.from_hf({**GPTQ_CONFIG, "group_size": group or -1})
    gate, up, down = torch.randn(512, 256) * 0.05, torch.randn(512, 256) * 0.05, torch.randn(256, 512) * 0.05
    parts = {name: gptq_tensors(w, group) for name, w in (("gate", gate), ("up", up), ("down", down))}
    x = torch.randn(3, 256)
    h_ref = torch.cat([x @ dequantized(parts[p], group).t() for p in ("gate", "up")], -1)
    y_ref = h_ref[:, :512] @ dequantized(parts["down"], group).t()
    partial = []
    for rank in range(2):
        with building_for(TensorParallelGroup(rank, 2)), quantization_scope(config):
            gate_up = MergedColumnParallelLinear(256, [512, 512])
            row = RowParallelLinear(512, 256, reduce_results=False)
        for shard, p in enumerate(("gate", "up")):
            for key, t in parts[p].items():
                gate_up.weight_loader(getattr(gate_up, key), t, shard)
        for key, t in parts["down"].items():
            row.weight_loader(getattr(row, key), t)
        gate_up.process_weights_after_loading()
        row.process_weights_after_loading()
        h = gate_up(x)
        rows = slice(256 * rank, 256 * (rank + 1))
        torch.testing.assert_close(h, torch.cat([h_ref[:, rows], h_ref[:, 512:][:, rows]], -1))
        partial.append(row(h_ref[:, :512][:, rows]))
    torch.testing.assert_close(sum(partial), y_ref)


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _narrow_qzeros(tensors):
    name = "model.layers.0.self_attn.o_proj.qzeros"
    tensors[name] = tensors[name][:, :-1].contiguous()


def _act_order_g_idx(tensors):
    name = "model.layers.1.mlp.down_proj.g_idx"  # a permuted channel-to-group map, as desc_act writes
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]


def _g_idx_differs_between_parts(tensors):
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = torch.zeros_like(tensors[name])


@pytest.mark.parametrize("corrupt, message", [
    # one projection of a merged layer: the other's tensor fills the same parameter
    (_drop("model.layers.0.mlp.gate_proj.scales"), r"part\(s\) \[0\] of model.layers.0.mlp.gate_up_proj.scales"),
    (_drop("model.layers.1.self_attn.o_proj.qzeros"), "o_proj.qzeros"),
    (_narrow_qzeros, "shape"),
    (_act_order_g_idx, "g_idx is not k // group_size"),
    (_g_idx_differs_between_parts, "g_idx is not k // group_size"),
], ids=["missing-scales", "missing-qzeros", "wrong-qzeros-shape", "act-order-g_idx", "g_idx-differs"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, corrupt, message):
    path = write_checkpoint(base_model(), str(tmp_path / "bad"), corrupt=corrupt)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


def test_desc_act_with_the_trivial_g_idx_loads(tmp_path, checkpoint, llm):
    path = str(tmp_path / "desc-act")
    shutil.copytree(checkpoint, path)
    set_config(path, {**GPTQ_CONFIG, "desc_act": True, "static_groups": True})
    assert greedy(LLM(path, dtype="float32", device="cpu", max_model_len=128)) == greedy(llm)


def set_config(path: str, qc: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("change, message", [
    ({"sym": False}, "sym false"),
    ({"checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2'"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"bits": 8}, "bits 8"),
    ({"group_size": 96}, "group_size 96 does not divide"),  # a multiple of 8 that does not divide K = 256
    ({"group_size": 100}, "group_size 100"),
    ({"lm_head": True}, "lm_head"),
    ({"dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ({"something_new": 1}, "something_new"),
], ids=["asymmetric", "v2", "marlin", "8-bit", "group-not-dividing-k", "group-not-multiple-of-8",
        "quantized-lm-head", "dynamic", "unknown-option"])
def test_unsupported_configs_are_refused_naming_the_option(tmp_path, checkpoint, change, message):
    path = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, path)
    set_config(path, {**GPTQ_CONFIG, **change})
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


def test_random_weights_fill_the_checkpoint_tensors_at_a_sensible_scale(tmp_path):
    """A bare config.json (benchmarks): the format's own tensors are filled directly, then
    converted like a checkpoint's; what they hold is the bits per weight the roofline counts."""
    cfg = llama_config().to_dict()
    cfg["quantization_config"] = GPTQ_CONFIG
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
