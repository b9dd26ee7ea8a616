"""What the quantized-checkpoint tests share: a tiny Llama and the prompts run on it, checkpoints
written or edited on disk (corrupted or with a refused ``quantization_config``), the engine's
greedy tokens and next-token log-probabilities to hold against a reference, and the layer-by-layer
pairing of the engine's linear layers with a transformers model's weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepbatch import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 31], [1, 2, 3], [300, 12, 7, 7, 7, 44, 90, 18, 201, 6, 66], [7, 8, 9, 10, 11],
           [200, 100, 50, 25]]
FP8_BLOCK = (128, 128)
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": list(FP8_BLOCK)}

# A checkpoint tensor's stored form: ``quantize(name, tensor)`` gives the tensors written in its
# place by name, or None to keep it as it is.
Quantize = Callable[[str, torch.Tensor], dict | None]
Corrupt = Callable[[dict], None]


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    # Every dim a multiple of 128 (one 4-bit group, one FP8 block) except where a test says.
    args = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return LlamaConfig(**{**args, **overrides})


def base_model(seed: int = 0, **overrides):
    """A float32 transformers Llama on ``tiny_llama_config(**overrides)``, seeded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_llama_config(**overrides), dtype=torch.float32).eval()


def float32_llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, **kwargs)


def quantize_tensors(tensors: dict[str, torch.Tensor], quantize: Quantize) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        stored = quantize(name, t)
        out.update({name: t.contiguous()} if stored is None else stored)
    return out


def is_layer_projection(name: str, t: torch.Tensor) -> bool:
    """A decoder layer's linear weight (attention and MLP projections, MLA's included)."""
    return name.startswith("model.layers.") and name.endswith(("proj.weight", "proj_with_mqa.weight")) and t.dim() == 2


def fp8_block_quantized(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """DeepSeek-V3's FP8 layout for every layer projection: e4m3 ``weight`` + ``weight_scale_inv``."""
    from deepbatch.layers.quantization.fp8 import quantize_fp8_blocks

    if not is_layer_projection(name, t):
        return None
    q, s = quantize_fp8_blocks(t, FP8_BLOCK)
    return {name: q, name.removesuffix("weight") + "weight_scale_inv": s}


def set_quantization_config(path: str, qc: dict) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def quantization_config_of(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["quantization_config"]


def write_checkpoint(model, path: str, qc: dict, quantize: Quantize, corrupt: Corrupt | None = None) -> str:
    """``model`` saved in the format ``qc`` names, its tensors stored by ``quantize``; ``corrupt``
    edits them before they are written."""
    tensors = quantize_tensors(model.state_dict(), quantize)
    if corrupt:
        corrupt(tensors)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    set_quantization_config(path, qc)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def copy_checkpoint(src: str, dst: str, qc: dict | None = None, corrupt: Corrupt | None = None) -> str:
    """A copy of checkpoint ``src`` with its quantization_config replaced by ``qc`` and its tensors
    edited by ``corrupt``."""
    shutil.copytree(src, dst)
    if qc is not None:
        set_quantization_config(dst, qc)
    if corrupt is not None:
        tensors = load_file(os.path.join(dst, "model.safetensors"))
        corrupt(tensors)
        save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def drop_tensor(name: str) -> Corrupt:
    return lambda tensors: tensors.pop(name)


def edit_tensor(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Corrupt:
    def corrupt(tensors):
        tensors[name] = fn(tensors[name]).contiguous()
    return corrupt


def assert_load_refused(path: str, message: str) -> None:
    """The checkpoint fails to load with a ValueError that says ``message`` (a regex)."""
    with pytest.raises(ValueError, match=message):
        float32_llm(path)


def linear_layers_and_references(llm: LLM, hf) -> list[tuple[int, str, torch.nn.Module, torch.Tensor]]:
    """``(layer index, name, our layer, the transformers weight it holds)`` for each linear layer of
    each decoder layer, merged projections against their parts concatenated."""
    ours = llm.engine.runner.model
    ref = dict(hf.named_parameters())
    assert len(ours.model.layers) == hf.config.num_hidden_layers
    pairs = []
    for i, layer in enumerate(ours.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([ref[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = torch.cat([ref[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        pairs += [(i, "qkv_proj", attn.qkv_proj, qkv),
                  (i, "o_proj", attn.o_proj, ref[f"model.layers.{i}.self_attn.o_proj.weight"]),
                  (i, "gate_up_proj", mlp.gate_up_proj, gate_up),
                  (i, "down_proj", mlp.down_proj, ref[f"model.layers.{i}.mlp.down_proj.weight"])]
    return pairs


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def last_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """A transformers model's log-probabilities of the token after ``prompt``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)


def next_token_gaps(llm: LLM, prompts: list[list[int]], references: list[Callable[[list[int]], torch.Tensor]],
                    top_k: int = 20, tie: float | None = None) -> list[float]:
    """Our log-probabilities of the token after each prompt held to each reference's (``prompt ->
    log-probs``): per reference, the largest difference over our ``top_k`` tokens. Our greedy token
    is the first reference's argmax, or with ``tie`` within that much of its best (a near-tie that
    activation rounding may decide either way)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k), use_tqdm=False)
    worst = [0.0] * len(references)
    for prompt, out in zip(prompts, outs):
        refs = [reference(prompt) for reference in references]
        token = out.outputs[0].token_ids[0]
        if tie is None:
            assert token == int(refs[0].argmax()), (prompt, token)
        else:
            assert float(refs[0].max() - refs[0][token]) < tie, (prompt, token)
        top = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items() if lp.rank <= top_k}
        assert len(top) == top_k
        for j, ref in enumerate(refs):
            worst[j] = max(worst[j], max(abs(lp - float(ref[tok])) for tok, lp in top.items()))
    return worst


def assert_two_ranks_recombine(config, tensors: dict[str, dict[str, torch.Tensor]],
                               weights: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    """An MLP's checkpoint tensors (``tensors[p][key]`` for p in gate, up, down) cut over two
    tensor-parallel ranks simulated in one process, against the dense ``weights[p]`` ``[N, K]`` they
    hold: gate|up column-parallel (each rank's output is its rows of each part), down row-parallel
    (the ranks' partial products sum to the whole)."""
    from deepbatch.distributed.parallel_state import TensorParallelGroup, building_for
    from deepbatch.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from deepbatch.layers.quantization import quantization_scope

    inter, hidden = weights["gate"].shape
    gate, up = (x @ weights[p].t() for p in ("gate", "up"))
    y_ref = gate @ weights["down"].t()
    partial = []
    for rank in range(2):
        with building_for(TensorParallelGroup(rank, 2)), quantization_scope(config):
            gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
            down = RowParallelLinear(inter, hidden, reduce_results=False)
        for shard, p in enumerate(("gate", "up")):
            for key, t in tensors[p].items():
                gate_up.weight_loader(getattr(gate_up, key), t, shard)
        for key, t in tensors["down"].items():
            down.weight_loader(getattr(down, key), t)
        gate_up.process_weights_after_loading()
        down.process_weights_after_loading()
        rows = slice(inter // 2 * rank, inter // 2 * (rank + 1))
        torch.testing.assert_close(gate_up(x), torch.cat([gate[:, rows], up[:, rows]], -1))
        partial.append(down(gate[:, rows]))
    torch.testing.assert_close(sum(partial), y_ref)


def write_bare_config(path, config, qc: dict) -> str:
    """A config.json alone (what a benchmark builds random weights from), in format ``qc``."""
    cfg = config.to_dict()
    cfg["quantization_config"] = qc
    path.write_text(json.dumps(cfg))
    return str(path)


def assert_random_w4a16_weights_at_a_sensible_scale(tmp_path, qc: dict) -> None:
    """A bare config.json in a 4-bit format: its own tensors are filled directly, then converted like
    a checkpoint's; what they hold is the bits per weight the roofline counts, and it generates."""
    llm = LLM(write_bare_config(tmp_path / "config.json", tiny_llama_config(), qc), dtype="bfloat16", device="cpu",
              max_model_len=128)
    for layer in (llm.engine.runner.model.model.layers[0].self_attn.qkv_proj,
                  llm.engine.runner.model.model.layers[0].mlp.down_proj):
        assert sorted(n for n, _ in layer.named_parameters()) == ["qweight", "scales", "zeros"]
        assert torch.equal(layer.zeros, torch.full_like(layer.zeros, 8.0))
        assert 0.015 < float(layer.quant_method.dequantize(layer).float().std()) < 0.025
        stored = sum(p.numel() * p.element_size() * 8 for p in layer.parameters())
        assert stored / (layer.in_features * layer.out_features) == llm.engine.runner.model.quantization.weight_bits()
    assert len(greedy_ids(llm, [[1, 2, 3]], max_tokens=4)[0]) == 4
