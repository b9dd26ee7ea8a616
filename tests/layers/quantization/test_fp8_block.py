"""FP8 block-wise checkpoints in DeepSeek-V3's layout (e4m3 ``weight`` + ``weight_scale_inv`` per
128 x 128 block, ``quant_method: "fp8"``), held to HF transformers reading the same files: its
FP8 loader dequantizes them on the CPU, so its model is the reference on the dequantized weights.
deepbatch also quantizes the activations (per token and 128 columns), so its logits are held to a
stated tolerance, and each layer's weight to HF's exactly."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch

from quanttest_common import (FP8_BLOCK, FP8_BLOCK_CONFIG, PROMPTS, assert_load_refused, base_model, copy_checkpoint,
                              drop_tensor, edit_tensor, float32_llm, fp8_block_quantized, greedy_ids, last_logprobs,
                              linear_layers_and_references, next_token_gaps, write_checkpoint)


def fp8_model(seed: int):
    # Every projection a whole number of 128 x 128 blocks except kv (128 + 128 rows: two parts of one
    # block each), so merged q|k|v and gate|up cut on block boundaries.
    return base_model(seed, intermediate_size=384)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(fp8_model(seed=0), str(tmp_path_factory.mktemp("fp8") / "llama"), FP8_BLOCK_CONFIG,
                            fp8_block_quantized)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    # On a machine without an FP8 GPU, transformers' FP8 quantizer dequantizes while loading.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    return float32_llm(checkpoint)


def test_each_layer_dequantizes_to_what_transformers_reads(llm, hf_model):
    pairs = linear_layers_and_references(llm, hf_model)
    assert len(pairs) == 8
    for _, _, layer, ref in pairs:
        assert layer.quant_method.name == "fp8-block"
        assert layer.weight.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(layer.quant_method.dequantize(layer), ref.float(), rtol=0, atol=0)


def fake_quantize_activations(x: torch.Tensor, group: int = FP8_BLOCK[1]) -> torch.Tensor:
    """Round ``x`` to e4m3 with one scale per token and ``group`` columns, and back: what a W8A8
    layer feeds its GEMM, written here in plain torch for the reference model."""
    rows = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[1], group):
        g = rows[:, start:start + group]
        scale = (g.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-10)
        out[:, start:start + group] = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return out.view(x.shape).to(x.dtype)


@contextlib.contextmanager
def rounded_activations(model):
    """``model``'s decoder-layer linear inputs rounded by ``fake_quantize_activations`` while inside."""
    hooks = [m.register_forward_pre_hook(lambda m, args: (fake_quantize_activations(args[0]),))
             for n, m in model.named_modules() if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def reference_logprobs(model, prompt, quantize_activations: bool) -> torch.Tensor:
    with rounded_activations(model) if quantize_activations else contextlib.nullcontext():
        return last_logprobs(model, prompt)


def test_logits_match_transformers_with_the_same_activation_rounding(llm, hf_model):
    """Against transformers' model on the dequantized weights with its linear inputs rounded the
    same way: equal but for the rare activation whose float32 value differs in the last bits between
    the two implementations and so rounds to the neighbouring e4m3 value (a hundredth here). Against
    the unrounded model: the activation rounding itself (e4m3 keeps 3 mantissa bits), about half a
    unit of log-probability on this random model."""
    worst_same, worst_plain = next_token_gaps(llm, PROMPTS[:3], [
        partial(reference_logprobs, hf_model, quantize_activations=True),
        partial(reference_logprobs, hf_model, quantize_activations=False)])
    assert worst_same < 0.1, worst_same
    assert worst_same < worst_plain / 5, (worst_same, worst_plain)
    assert worst_plain < 1.5, worst_plain


def test_greedy_tokens_follow_transformers_but_at_near_ties(llm, hf_model):
    """Greedy continuations agree with transformers' (inputs rounded the same way) token for token
    until the two pick different tokens, which may only happen where the reference itself rates
    both within a hair: a rounding flip decides a near-tie, never a clear choice."""
    from tests.models.hf_reference import hf_greedy_ids

    with rounded_activations(hf_model):
        ref = hf_greedy_ids(hf_model, PROMPTS, 8)
        identical = 0
        for prompt, got, want in zip(PROMPTS, greedy_ids(llm, PROMPTS), ref):
            if got == want:
                identical += 1
                continue
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            lp = last_logprobs(hf_model, prompt + want[:i])
            assert float(lp[want[i]] - lp[got[i]]) < 0.05, (prompt, i, got, want)
    assert identical >= len(PROMPTS) - 1


@pytest.mark.parametrize("corrupt, message", [
    (drop_tensor("model.layers.1.mlp.down_proj.weight_scale_inv"), "weight_scale_inv"),
    (edit_tensor("model.layers.0.self_attn.o_proj.weight_scale_inv", lambda t: t[:1]), "shape"),
    (drop_tensor("model.layers.0.self_attn.k_proj.weight_scale_inv"),
     r"part\(s\) \[1\] of model.layers.0.self_attn.qkv_proj"),
], ids=["missing-scale", "wrong-scale-shape", "missing-merged-part"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, corrupt, message):
    path = write_checkpoint(fp8_model(seed=1), str(tmp_path / "bad"), FP8_BLOCK_CONFIG, fp8_block_quantized, corrupt)
    assert_load_refused(path, message)


@pytest.mark.parametrize("qc, message", [
    ({**FP8_BLOCK_CONFIG, "weight_block_size": None}, "per-tensor"),
    ({**FP8_BLOCK_CONFIG, "activation_scheme": "static"}, "activation_scheme"),
    ({**FP8_BLOCK_CONFIG, "fmt": "e5m2"}, "fmt"),
    ({**FP8_BLOCK_CONFIG, "weight_block_size": [128, 0]}, "weight_block_size"),
    ({**FP8_BLOCK_CONFIG, "something_new": 1}, "something_new"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
], ids=["no-block", "static", "e5m2", "zero-block", "unknown-option", "unknown-method"])
def test_unsupported_configs_are_refused_naming_the_option(tmp_path, checkpoint, qc, message):
    assert_load_refused(copy_checkpoint(checkpoint, str(tmp_path / "ckpt"), qc=qc), message)
