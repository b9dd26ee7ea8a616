"""A tiny DeepSeek-V3 in its own FP8 layout (every projection of every layer, MLA's and the routed
and shared experts', e4m3 with 128 x 128 ``weight_scale_inv`` blocks; router, norms, embedding
and head in full precision), held to HF transformers reading the same files (its FP8 loader
dequantizes them on the CPU)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file

from quanttest_common import (FP8_BLOCK_CONFIG, PROMPTS, float32_llm, fp8_block_quantized, last_logprobs,
                              next_token_gaps, quantize_tensors, set_quantization_config)


def v3_config():
    from transformers import DeepseekV3Config

    # Every dim a multiple of 128: transformers derives the block from the scale grid (rows /
    # scale rows), which is DeepSeek's 128 only where no block is partial. (Partial last blocks, as
    # in V3's kv_a_proj_with_mqa of 576 rows, are held to the format's definition in
    # tests/kernels/test_fp8_quant.py.)
    return DeepseekV3Config(vocab_size=384, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
                            num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128,
                            qk_rope_head_dim=128, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                            routed_scaling_factor=2.5, max_position_embeddings=512, initializer_range=0.08,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(v3_config(), dtype=torch.float32)
    path = str(tmp_path_factory.mktemp("fp8-v3") / "v3")
    model.save_pretrained(path)  # transformers' own names for every tensor (experts one by one)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(path, f)))
        os.remove(os.path.join(path, f))
    out = quantize_tensors(tensors, fp8_block_quantized)
    assert any(".experts.0.gate_proj.weight_scale_inv" in n for n in out), sorted(out)[:20]
    save_file(out, os.path.join(path, "model.safetensors"))
    set_quantization_config(path, FP8_BLOCK_CONFIG)
    return path


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    return float32_llm(checkpoint)


def test_experts_and_projections_dequantize_to_what_transformers_reads(llm, hf_model):
    ours = llm.engine.runner.model.model.layers[1]
    hf = dict(hf_model.named_parameters())
    experts = ours.mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    w13, w2 = experts.quant_method.dequantize(experts)
    torch.testing.assert_close(w13, hf["model.layers.1.mlp.experts.gate_up_proj"].float(), rtol=0, atol=0)
    torch.testing.assert_close(w2, hf["model.layers.1.mlp.experts.down_proj"].float(), rtol=0, atol=0)
    attn = ours.self_attn
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        layer = getattr(attn, name)
        assert layer.weight.dtype == torch.float8_e4m3fn, name
        torch.testing.assert_close(layer.quant_method.dequantize(layer),
                                   hf[f"model.layers.1.self_attn.{name}.weight"].float(), rtol=0, atol=0)
    # The absorbed attention reads kv_b_proj's matrix: kept dequantized, equal to transformers'.
    torch.testing.assert_close(attn.kv_b_proj.weight, hf["model.layers.1.self_attn.kv_b_proj.weight"].float(),
                               rtol=0, atol=0)
    shared = ours.mlp.shared_experts.gate_up_proj
    assert shared.weight.dtype == torch.float8_e4m3fn
    # The router stays in float32, as the checkpoint has it.
    assert ours.mlp.gate.weight.dtype == torch.float32


def test_next_token_distribution_matches_transformers_within_the_activation_rounding(llm, hf_model):
    """transformers runs the dequantized weights on full-precision activations; deepbatch rounds
    every GEMM input to e4m3 per token and 128 columns, which moves these log-probabilities by a
    few tenths at most on this random model (a misplaced block scale moves them by whole units)."""
    # Our greedy token is the reference's own choice, or a near-tie of it.
    worst, = next_token_gaps(llm, PROMPTS[:3], [partial(last_logprobs, hf_model)], tie=0.1)
    assert worst < 1.0, worst
