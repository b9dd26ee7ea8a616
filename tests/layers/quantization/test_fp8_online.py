"""``--quantization fp8`` on 16-bit checkpoints: each linear layer's weight is quantized per output
channel while loading (MoE experts block-wise), held to a per-channel quantization written here
in plain torch and to HF transformers on the original weights; and random weights built directly
in a quantized format for benchmarks."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from deepbatch import LLM, SamplingParams
from quanttest_common import PROMPTS, last_logprobs, next_token_gaps, tiny_llama_config, write_bare_config


def per_channel_fp8(w: torch.Tensor) -> torch.Tensor:
    """The weight as an e4m3 per-output-channel checkpoint would hold it, back in float32."""
    scale = w.float().abs().amax(1, keepdim=True) / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn).float() * scale


@pytest.fixture(scope="module")
def online(tiny_checkpoints):
    return LLM(tiny_checkpoints["qwen2"], dtype="float32", device="cpu", quantization="fp8")


def test_every_projection_is_stored_in_fp8_per_channel(online, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    hf = dict(AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"], dtype=torch.float32).named_parameters())
    model = online.engine.runner.model
    for i, layer in enumerate(model.model.layers):
        qkv = layer.self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.shape == (qkv.weight.shape[0], 1)
        want = torch.cat([per_channel_fp8(hf[f"model.layers.{i}.self_attn.{p}_proj.weight"]) for p in "qkv"])
        torch.testing.assert_close(qkv.quant_method.dequantize(qkv), want, rtol=1e-6, atol=0)
        # Biases stay in the model dtype and are still added.
        torch.testing.assert_close(qkv.bias, torch.cat([hf[f"model.layers.{i}.self_attn.{p}_proj.bias"] for p in "qkv"]))
        down = layer.mlp.down_proj
        torch.testing.assert_close(down.quant_method.dequantize(down),
                                   per_channel_fp8(hf[f"model.layers.{i}.mlp.down_proj.weight"]), rtol=1e-6, atol=0)
    # Embedding and head keep their precision.
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_outputs_stay_close_to_the_16_bit_model(online, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"], dtype=torch.float32).eval()
    worst, = next_token_gaps(online, PROMPTS[:3], [partial(last_logprobs, hf)], top_k=5, tie=0.1)
    assert worst < 0.5, worst


def test_a_moe_model_quantizes_its_experts_block_wise(tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    cfg = DeepseekV2Config(vocab_size=384, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                           num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                           kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None,
                           topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=256,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="fp8", max_model_len=128)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj_scale_inv.shape == (8, 2, 1)  # [E, 2I/128, H/128]
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_online_methods_other_than_fp8_are_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="cannot be applied to a 16-bit checkpoint"):
        LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", quantization="awq")


def test_random_weights_are_built_in_the_config_format(tmp_path):
    """A benchmark config with a quantization_config gets its random weights in that layout."""
    config = tiny_llama_config(intermediate_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=256)
    path = write_bare_config(tmp_path / "llama-fp8.json", config,
                             {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    llm = LLM(path, dtype="float32", device="cpu", random_weights=True, max_model_len=128)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.shape == (4, 2)  # (256 + 128 + 128) x 256
    w = qkv.quant_method.dequantize(qkv)
    assert 0.01 < float(w.std()) < 0.04  # N(0, 0.02) through the block quantization
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2, temperature=0.0,
                                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
