"""FP8 block-wise checkpoints in DeepSeek-V3's layout (e4m3 ``weight`` + ``weight_scale_inv`` per
128 x 128 block, ``quant_method: "fp8"``), held to HF transformers reading the same files: its
FP8 loader dequantizes them on the CPU, so its model is the reference on the dequantized weights.
deepbatch also quantizes the activations (per token and 128 columns), so its logits are held to a
stated tolerance, and each layer's weight to HF's exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from deepbatch import LLM, SamplingParams
from deepbatch.layers.quantization.fp8 import quantize_fp8_blocks

BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
PROMPTS = [[5, 17, 99, 3, 250, 31], [1, 2, 3], [300, 12, 7, 7, 7, 44, 90, 18, 201, 6, 66]]


def llama_config():
    from transformers import LlamaConfig

    # Every projection a whole number of 128 x 128 blocks except kv (128 + 128 rows: two parts of one
    # block each), so merged q|k|v and gate|up cut on block boundaries.
    return LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.08, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("proj.weight") and t.dim() == 2


def write_fp8_checkpoint(model, path: str, corrupt=None) -> str:
    """The model's linear weights in DeepSeek-V3's FP8 layout; everything else as it was."""
    tensors = {}
    for name, t in model.state_dict().items():
        if is_quantized_linear(name, t):
            q, s = quantize_fp8_blocks(t, BLOCK)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, s
        else:
            tensors[name] = t.contiguous()
    if corrupt:
        corrupt(tensors)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = FP8_CONFIG
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    return write_fp8_checkpoint(model, str(tmp_path_factory.mktemp("fp8") / "llama"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    # On a machine without an FP8 GPU, transformers' FP8 quantizer dequantizes while loading.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", device="cpu", max_model_len=128)


def test_each_layer_dequantizes_to_what_transformers_reads(llm, hf_model):
    ours = llm.engine.runner.model
    hf = dict(hf_model.named_parameters())
    checked = 0
    for i in range(2):
        attn, mlp = ours.model.layers[i].self_attn, ours.model.layers[i].mlp
        assert attn.qkv_proj.quant_method.name == "fp8-block"
        qkv = torch.cat([hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([hf[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for layer, ref in ((attn.qkv_proj, qkv), (attn.o_proj, hf[f"model.layers.{i}.self_attn.o_proj.weight"]),
                           (mlp.gate_up_proj, gate_up), (mlp.down_proj, hf[f"model.layers.{i}.mlp.down_proj.weight"])):
            assert layer.weight.dtype == torch.float8_e4m3fn
            torch.testing.assert_close(layer.quant_method.dequantize(layer), ref.float(), rtol=0, atol=0)
            checked += 1
    assert checked == 8


def fake_quantize_activations(x: torch.Tensor, group: int = BLOCK[1]) -> torch.Tensor:
    """Round ``x`` to e4m3 with one scale per token and ``group`` columns, and back: what a W8A8
    layer feeds its GEMM, written here in plain torch for the reference model."""
    rows = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[1], group):
        g = rows[:, start:start + group]
        scale = (g.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-10)
        out[:, start:start + group] = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return out.view(x.shape).to(x.dtype)


def reference_logprobs(model, prompt, quantize_activations: bool) -> torch.Tensor:
    hooks = []
    if quantize_activations:
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                hooks.append(module.register_forward_pre_hook(lambda m, args: (fake_quantize_activations(args[0]),)))
    try:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    finally:
        for h in hooks:
            h.remove()


def test_logits_match_transformers_with_the_same_activation_rounding(llm, hf_model):
    """Against transformers' model on the dequantized weights with its linear inputs rounded the
    same way: equal but for the rare activation whose float32 value differs in the last bits between
    the two implementations and so rounds to the neighbouring e4m3 value (a hundredth here). Against
    the unrounded model: the activation rounding itself (e4m3 keeps 3 mantissa bits), about half a
    unit of log-probability on this random model."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    worst_same, worst_plain = 0.0, 0.0
    for prompt, out in zip(PROMPTS, outs):
        same = reference_logprobs(hf_model, prompt, quantize_activations=True)
        plain = reference_logprobs(hf_model, prompt, quantize_activations=False)
        assert out.outputs[0].token_ids[0] == int(same.argmax())
        _, top = out.outputs[0].logprobs[0]
        assert len(top) == 20
        for tok, lp in top.items():
            worst_same = max(worst_same, abs(lp - float(same[tok])))
            worst_plain = max(worst_plain, abs(lp - float(plain[tok])))
    assert worst_same < 0.1, worst_same
    assert worst_same < worst_plain / 5, (worst_same, worst_plain)
    assert worst_plain < 1.5, worst_plain


def test_greedy_tokens_follow_transformers_but_at_near_ties(llm, hf_model):
    """Greedy continuations agree with transformers' (inputs rounded the same way) token for token
    until the two pick different tokens, which may only happen where the reference itself rates
    both within a hair: a rounding flip decides a near-tie, never a clear choice."""
    from tests.models.hf_reference import hf_greedy_ids

    prompts = PROMPTS + [[7, 8, 9, 10, 11], [200, 100, 50, 25]]
    hooks = [m.register_forward_pre_hook(lambda m, args: (fake_quantize_activations(args[0]),))
             for n, m in hf_model.named_modules() if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)]
    try:
        ref = hf_greedy_ids(hf_model, prompts, 8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        identical = 0
        for prompt, out, want in zip(prompts, outs, ref):
            got = out.outputs[0].token_ids
            if got == want:
                identical += 1
                continue
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            with torch.no_grad():
                lp = torch.log_softmax(hf_model(torch.tensor([prompt + want[:i]])).logits[0, -1].float(), -1)
            assert float(lp[want[i]] - lp[got[i]]) < 0.05, (prompt, i, got, want)
    finally:
        for h in hooks:
            h.remove()
    assert identical >= len(prompts) - 1


def _drop_scale(tensors):
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]


def _drop_one_part(tensors):
    del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]


def _bad_scale_shape(tensors):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1]


@pytest.mark.parametrize("corrupt, message", [(_drop_scale, "weight_scale_inv"), (_bad_scale_shape, "shape"),
                                             (_drop_one_part, r"part\(s\) \[1\] of model.layers.0.self_attn.qkv_proj")],
                         ids=["missing-scale", "wrong-scale-shape", "missing-merged-part"])
def test_corrupt_checkpoints_fail_to_load_with_a_clear_error(tmp_path, corrupt, message):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    path = write_fp8_checkpoint(model, str(tmp_path / "bad"), corrupt)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)


@pytest.mark.parametrize("qc, message", [
    ({**FP8_CONFIG, "weight_block_size": None}, "per-tensor"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme"),
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt"),
    ({**FP8_CONFIG, "weight_block_size": [128, 0]}, "weight_block_size"),
    ({**FP8_CONFIG, "something_new": 1}, "something_new"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
], ids=["no-block", "static", "e5m2", "zero-block", "unknown-option", "unknown-method"])
def test_unsupported_configs_are_refused_naming_the_option(tmp_path, checkpoint, qc, message):
    import shutil

    path = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", device="cpu", max_model_len=128)
