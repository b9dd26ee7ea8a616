"""The roofline's weight bytes, held to the parameter count of transformers' own model built on the
meta device from the same config (no memory), in 16 bits and in the quantized formats."""

from __future__ import annotations

import json

import pytest
import torch

from deepbatch.bench.roofline import model_cost

MODELS = "benchmarks/models"


def load(name: str):
    from transformers import AutoConfig

    with open(f"{MODELS}/{name}.json") as f:
        return AutoConfig.for_model(**json.load(f))


def hf_params(cfg) -> tuple[int, int]:
    """(all parameters, those outside the decoder layers' projections) of transformers' model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    projections = sum(p.numel() for n, p in model.named_parameters()
                      if n.startswith("model.layers.") and ("proj" in n or "experts" in n) and p.dim() >= 2)
    return total, total - projections


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b", "deepseek-v2-lite"])
def test_16_bit_weight_bytes_count_every_parameter(name):
    cfg = load(name)
    total, _ = hf_params(cfg)
    # Norms (a few hidden-sized vectors per layer) are the only parameters the roofline leaves out.
    assert model_cost(cfg, 2).weight_bytes == pytest.approx(2 * total, rel=2e-3)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v2-lite"])
def test_fp8_block_weights_take_one_byte_per_projection_weight(name):
    from deepbatch.layers.quantization.fp8 import Fp8Config

    cfg = load(name)
    total, other = hf_params(cfg)
    bits = Fp8Config((128, 128)).weight_bits()
    assert bits == 8 + 32 / 128**2
    got = model_cost(cfg, 2, weight_bits=bits).weight_bytes
    kv_b = 0
    if getattr(cfg, "kv_lora_rank", None):  # MLA keeps kv_b_proj dequantized
        kv_b = cfg.num_hidden_layers * cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    want = (total - other - kv_b) * bits / 8 + (other + kv_b) * 2
    assert got == pytest.approx(want, rel=2e-3)
    assert got < 0.6 * model_cost(cfg, 2).weight_bytes


@pytest.mark.parametrize("n,window", [(1, None), (7, None), (7, 3), (7, 7), (7, 9), (100, 16)])
def test_causal_pairs_count_what_a_windowed_causal_mask_keeps(n, window):
    from deepbatch.bench.roofline import causal_pairs

    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    assert causal_pairs(n, window) == int(mask.sum())


def test_prefill_attention_window_and_kv_capacity_move_the_ceiling():
    from dataclasses import replace

    from deepbatch.bench.roofline import workload_ceiling

    cost = model_cost(load("llama-3.1-8b"), 2)
    # QK and PV: 2 * 2 * head_dim FLOPs per head and layer for each (query, key) pair.
    assert cost.attn_flops_per_pair == 32 * 32 * 4 * 128
    prompts, outs = [8192] * 64, [512] * 64
    plain = workload_ceiling(cost, prompts, outs)
    assert plain < workload_ceiling(replace(cost, attn_flops_per_pair=0.0), prompts, outs)
    assert workload_ceiling(cost, prompts, outs, window=4096) > plain
    # A pool of 16 full contexts runs 4 waves of 16 instead of one of 64: more weight reads.
    assert workload_ceiling(cost, prompts, outs, kv_capacity_tokens=16 * 8704) < plain
