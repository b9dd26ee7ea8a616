"""GPTQ checkpoints (4-bit, symmetric, ``checkpoint_format: "gptq"``). transformers reads GPTQ only
through optimum/GPTQModel on a GPU, so the checkpoint is written by a packer in this file, itself
checked bit for bit against the documented layout decoded by a plain-Python loop (qweight packed
along K and qzeros along N, nibble i of a word at bits 4i..4i+3, zero points stored minus one);
the reference is a transformers model on the weights ``(q - 8) * scale`` computed here from the
unpacked integers, never through deepbatch. Tensor parallelism: each rank's cut of the packed
tensors, simulated in one process, and a real TP=2 run over gloo."""

from __future__ import annotations

import pytest
import torch

from quanttest_common import (PROMPTS, assert_load_refused, assert_random_w4a16_weights_at_a_sensible_scale,
                              assert_two_ranks_recombine, base_model, copy_checkpoint, drop_tensor, edit_tensor,
                              float32_llm, greedy_ids, is_layer_projection, linear_layers_and_references,
                              write_checkpoint)
from tests.models.hf_reference import hf_greedy_ids

GROUP = 128
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
               "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq"}


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


def gptq_quantized(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    if not is_layer_projection(name, t):
        return None
    return {name.removesuffix("weight") + key: value for key, value in gptq_tensors(t).items()}


def write_gptq_checkpoint(model, path: str, corrupt=None) -> str:
    return write_checkpoint(model, path, GPTQ_CONFIG, gptq_quantized, corrupt)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_gptq_checkpoint(base_model(), str(tmp_path_factory.mktemp("gptq") / "llama"))


@pytest.fixture(scope="module")
def hf_model():
    model = base_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_layer_projection(name, p):
                p.copy_(dequantized(gptq_tensors(p.data)))
    return model


@pytest.fixture(scope="module")
def llm(checkpoint):
    return float32_llm(checkpoint)


def test_each_layer_dequantizes_to_the_packed_weights(llm, hf_model):
    assert llm.engine.runner.model.quantization.describe().startswith("gptq")
    for _, _, layer, ref in linear_layers_and_references(llm, hf_model):
        assert layer.quant_method.name == "gptq"
        torch.testing.assert_close(layer.quant_method.dequantize(layer), ref, rtol=0, atol=0)


def test_greedy_tokens_match_transformers_on_the_dequantized_weights(llm, hf_model):
    assert greedy_ids(llm, PROMPTS) == hf_greedy_ids(hf_model, PROMPTS, 8)


def test_tensor_parallel_two_ranks_over_gloo(checkpoint, hf_model):
    """Column-parallel layers cut qweight, scales and qzeros along N (qzeros by whole words),
    row-parallel ones along K (qweight by words of eight rows, scales and qzeros by groups)."""
    tp2 = float32_llm(checkpoint, tensor_parallel_size=2, distributed_timeout_s=30)
    try:
        layer = tp2.engine.runner.model.model.layers[0]  # rank 0's half of each layer
        assert layer.self_attn.qkv_proj.zeros.shape == (256 // GROUP, (256 + 2 * 128) // 2)
        assert layer.mlp.down_proj.qweight.shape == (512 // 2 // 8, 256)
        assert layer.mlp.down_proj.scales.shape == (512 // 2 // GROUP, 256)
        assert greedy_ids(tp2, PROMPTS) == hf_greedy_ids(hf_model, PROMPTS, 8)
    finally:
        tp2.engine.shutdown()


@pytest.mark.parametrize("group", [GROUP, None], ids=["group-128", "one-group-per-channel"])
def test_each_ranks_cut_recombines_into_the_whole_product(group):
    """Two ranks simulated in one process; ``group_size: -1`` keeps its one scale row whole."""
    from deepbatch.layers.quantization.gptq import GPTQConfig

    torch.manual_seed(0)
    config = GPTQConfig.from_hf({**GPTQ_CONFIG, "group_size": group or -1})
    gate, up, down = torch.randn(512, 256) * 0.05, torch.randn(512, 256) * 0.05, torch.randn(256, 512) * 0.05
    parts = {name: gptq_tensors(w, group) for name, w in (("gate", gate), ("up", up), ("down", down))}
    x = torch.randn(3, 256)
    assert_two_ranks_recombine(config, parts, {p: dequantized(t, group) for p, t in parts.items()}, x)


def _act_order_g_idx(t):
    return t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("corrupt, message", [
    # one projection of a merged layer: the other's tensor fills the same parameter
    (drop_tensor("model.layers.0.mlp.gate_proj.scales"), r"part\(s\) \[0\] of model.layers.0.mlp.gate_up_proj.scales"),
    (drop_tensor("model.layers.1.self_attn.o_proj.qzeros"), "o_proj.qzeros"),
    (edit_tensor("model.layers.0.self_attn.o_proj.qzeros", lambda t: t[:, :-1]), "shape"),
    # a permuted channel-to-group map, as desc_act writes
    (edit_tensor("model.layers.1.mlp.down_proj.g_idx", _act_order_g_idx), "g_idx is not k // group_size"),
    (edit_tensor("model.layers.0.self_attn.k_proj.g_idx", torch.zeros_like), "g_idx is not k // group_size"),
], ids=["missing-scales", "missing-qzeros", "wrong-qzeros-shape", "act-order-g_idx", "g_idx-differs"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, corrupt, message):
    assert_load_refused(write_gptq_checkpoint(base_model(), str(tmp_path / "bad"), corrupt=corrupt), message)


def test_desc_act_with_the_trivial_g_idx_loads(tmp_path, checkpoint, llm):
    path = copy_checkpoint(checkpoint, str(tmp_path / "desc-act"),
                           qc={**GPTQ_CONFIG, "desc_act": True, "static_groups": True})
    assert greedy_ids(float32_llm(path), PROMPTS) == greedy_ids(llm, PROMPTS)


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
    assert_load_refused(copy_checkpoint(checkpoint, str(tmp_path / "ckpt"), qc={**GPTQ_CONFIG, **change}), message)


def test_random_weights_fill_the_checkpoint_tensors_at_a_sensible_scale(tmp_path):
    assert_random_w4a16_weights_at_a_sensible_scale(tmp_path, GPTQ_CONFIG)
