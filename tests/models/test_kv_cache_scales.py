"""An fp8 KV cache uses the checkpoint's per-layer ``self_attn.k_scale``/``v_scale`` (as vLLM and
llm-compressor write them). The checkpoint is the tiny Llama with K and V made ``GAIN`` times
larger (q_proj and o_proj ``GAIN`` times smaller, so the model computes the same function): its
K/V reach past e4m3's 448, so a cache without the scales saturates them. The reference is HF
transformers on the same weights whose attention reads K and V through ``fp8(x / scale) * scale``
with the same per-layer scales, written here from the format's definition."""

from __future__ import annotations

import logging
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepbatch import LLM, SamplingParams
from hf_reference import hf_greedy_ids

GAIN = 200.0
FP8 = torch.float8_e4m3fn
# (k_scale, v_scale) per layer: |K|, |V| here stay under about 1400 (rotated K) and 1000, so
# neither reaches 448 after the division; none is a power of two, so the rounding differs from
# scale 1.0's too.
SCALES = {0: (3.5, 2.5), 1: (4.0, 3.0)}
UNIT = {layer: (1.0, 1.0) for layer in SCALES}
MAX_TOKENS = 12
WEIGHTS = "model.safetensors"


def attn_name(layer: int, what: str) -> str:
    return f"model.layers.{layer}.self_attn.{what}"


@pytest.fixture(scope="module")
def base(tiny_checkpoints, tmp_path_factory):
    """The rescaled checkpoint without scales, and its tensors."""
    path = tmp_path_factory.mktemp("kv_scales") / "base"
    shutil.copytree(tiny_checkpoints["llama"], path)
    state = load_file(path / WEIGHTS)
    for layer in SCALES:
        for proj, gain in (("q_proj", 1 / GAIN), ("k_proj", GAIN), ("v_proj", GAIN), ("o_proj", 1 / GAIN)):
            state[attn_name(layer, f"{proj}.weight")] *= gain
    save_file(state, path / WEIGHTS, metadata={"format": "pt"})
    return str(path), state


def with_tensors(base, dest, extra: dict[str, torch.Tensor]) -> str:
    """A copy of the base checkpoint with ``extra`` tensors added to its safetensors."""
    path, state = base
    shutil.copytree(path, dest)
    save_file({**state, **extra}, dest / WEIGHTS, metadata={"format": "pt"})
    return str(dest)


def scale_tensors(scales: dict[int, tuple[float, float]], shape=()) -> dict[str, torch.Tensor]:
    return {attn_name(layer, name): torch.full(shape, s) for layer, pair in scales.items()
            for name, s in zip(("k_scale", "v_scale"), pair)}


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    limit = torch.finfo(FP8).max
    return ((x / scale).clamp(-limit, limit).to(FP8).to(torch.float32) * scale).to(x.dtype)


_HF: dict = {}


def hf_greedy(path: str, prompts, scales: dict[int, tuple[float, float]] | None):
    """HF greedy continuations; with ``scales``, K and V read through the fp8 round trip."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key = (path, None if scales is None else tuple(sorted(scales.items())))
    if key not in _HF:
        impl = "sdpa"
        if scales is not None:
            impl = f"sdpa_fp8_scaled_{len(_HF)}"

            def attention(module, query, k, v, attention_mask, **kwargs):
                # HF hands attention every token's full-precision K/V each step; the round trip is a
                # pure function of each element, so this equals storing it once.
                k_scale, v_scale = scales[module.layer_idx]
                return sdpa_attention_forward(module, query, fp8_round_trip(k, k_scale), fp8_round_trip(v, v_scale),
                                              attention_mask, **kwargs)

            AttentionInterface.register(impl, attention)
        _HF[key] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval()
    model = _HF[key]
    return hf_greedy_ids(model, prompts, MAX_TOKENS)


def ours(path: str, prompts, kv_cache_dtype: str = "fp8"):
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def layer_scales(llm) -> dict[int, tuple[float, float]]:
    return {i: (a.k_scale, a.v_scale) for i, a in enumerate(llm.engine.runner.model.attention_layers())}


PROMPTS = (lambda rng: [[rng.randrange(3, 384) for _ in range(n)] for n in (3, 17, 40, 9, 60)])(random.Random(0))


def test_fp8_uses_the_checkpoint_scales(base, tmp_path, caplog):
    # Layer 0's as 0-d tensors (vLLM), layer 1's as shape [1] (llm-compressor).
    path = with_tensors(base, tmp_path / "scaled", {**scale_tensors({0: SCALES[0]}),
                                                    **scale_tensors({1: SCALES[1]}, shape=(1,))})
    want = hf_greedy(base[0], PROMPTS, SCALES)
    with caplog.at_level(logging.INFO, logger="deepbatch"):
        got, llm = ours(path, PROMPTS)
    assert layer_scales(llm) == SCALES
    assert "k_scale/v_scale" not in caplog.text
    assert got == want
    # Scale 1.0 saturates these K/V: a cache that ignored the scales would not match.
    saturated = hf_greedy(base[0], PROMPTS, UNIT)
    assert want != saturated
    # The engine's one start-up line tells the format and its bytes: 2 layers x (K, V) x 2 KV
    # heads x head_dim 16, one byte each.
    engine_lines = [r.getMessage() for r in caplog.records if r.name == "deepbatch.engine.llm_engine"
                    and r.getMessage().startswith("KV cache:")]
    assert len(engine_lines) == 1
    assert "kv_cache_dtype fp8 (float8_e4m3fn, per-layer K/V scales)" in engine_lines[0]
    assert f"{2 * 2 * 2 * 16 / 1024:.2f} KiB per token" in engine_lines[0]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepbatch"):
        got, llm = ours(base[0], PROMPTS)
    assert layer_scales(llm) == UNIT
    assert "no k_scale/v_scale for 2 of 2 attention layers" in caplog.text
    assert got == saturated


def test_partial_and_per_head_scales(base, tmp_path, caplog):
    # One scale per KV head (2 here) is taken as its largest; layer 1 has none.
    path = with_tensors(base, tmp_path / "partial", {attn_name(0, "k_scale"): torch.tensor([2.0, 3.5]),
                                                     attn_name(0, "v_scale"): torch.tensor(2.5)})
    with caplog.at_level(logging.WARNING, logger="deepbatch"):
        llm = LLM(path, dtype="float32", device="cpu", kv_cache_dtype="fp8")
    assert layer_scales(llm) == {0: SCALES[0], 1: (1.0, 1.0)}
    assert "no k_scale/v_scale for 1 of 2 attention layers" in caplog.text


BAD = {
    "negative": torch.tensor(-0.05),
    "zero": torch.tensor(0.0),
    "nan": torch.tensor(float("nan")),
    "inf": torch.tensor([float("inf")]),
    "vector": torch.tensor([0.05, 0.02, 0.1]),
    "matrix": torch.full((2, 2), 0.05),
    "per-head with a negative": torch.tensor([-1.0, 0.5]),
    "integer": torch.tensor(1, dtype=torch.int32),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_scale_fails_the_load_naming_it(base, tmp_path, kind):
    name = attn_name(1, "v_scale")
    path = with_tensors(base, tmp_path / "bad", {**scale_tensors(SCALES), name: BAD[kind]})
    with pytest.raises(ValueError, match=re.escape(repr(name)) + ": a KV cache scale must be"):
        LLM(path, dtype="float32", device="cpu", kv_cache_dtype="fp8")


def test_a_scale_for_a_layer_the_model_lacks_fails_the_load(base, tmp_path):
    name = attn_name(7, "k_scale")
    path = with_tensors(base, tmp_path / "extra", {name: torch.tensor(0.5)})
    with pytest.raises(ValueError, match=re.escape(repr(name)) + " has no attention layer"):
        LLM(path, dtype="float32", device="cpu", kv_cache_dtype="fp8")


def test_auto_loads_the_scales_and_ignores_them(base, tmp_path, caplog):
    path = with_tensors(base, tmp_path / "scaled", scale_tensors(SCALES))
    with caplog.at_level(logging.WARNING, logger="deepbatch"):
        got, llm = ours(path, PROMPTS, "auto")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float32
    assert "k_scale" not in caplog.text
    assert got == hf_greedy(base[0], PROMPTS, None)


def test_a_projection_scale_fails_the_load_naming_it(base, tmp_path):
    # Older fp8 formats put the KV scales on the projections; those are not read.
    name = attn_name(0, "k_proj.output_scale")
    path = with_tensors(base, tmp_path / "other", {name: torch.tensor(0.5)})
    with pytest.raises(ValueError, match=re.escape(repr(name)) + " has no parameter"):
        LLM(path, dtype="float32", device="cpu", kv_cache_dtype="fp8")


# -- calculate_kv_scales: scales measured at start-up for the layers the checkpoint leaves bare --


def hf_kv_absmax(path: str, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(max |K|, max |V|)`` per KV head over HF's unquantized forward of
    ``token_ids``, K after the rotary embedding, as attention receives them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attention(module, query, k, v, attention_mask, **kwargs):
        seen[module.layer_idx] = (k.abs().amax(dim=(0, 2, 3)), v.abs().amax(dim=(0, 2, 3)))  # [B, Hkv, L, D]
        return sdpa_attention_forward(module, query, k, v, attention_mask, **kwargs)

    AttentionInterface.register("sdpa_kv_absmax", attention)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa_kv_absmax")
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    return [seen[i] for i in sorted(seen)]


def calibrated(path: str, prompts=PROMPTS, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def calibration_prompt(llm) -> list[int]:
    """The engine's calibration prompt: its seeded ids, as many as the CPU path takes."""
    from deepbatch.layers.kv_scales import calibration_token_ids

    n = min(llm.engine.config.scheduler.max_num_batched_tokens, llm.engine.max_model_len, 512)  # CPU: 512
    return calibration_token_ids(llm.engine.hf_config.vocab_size, n).tolist()


def expected_scales(path: str, llm) -> dict[int, tuple[float, float]]:
    """2 x the largest |K|, |V| over HF's forward of the engine's calibration prompt, / 448."""
    from deepbatch.layers.kv_scales import HEADROOM

    limit = torch.finfo(FP8).max
    return {i: (float(k.max()) * HEADROOM / limit, float(v.max()) * HEADROOM / limit)
            for i, (k, v) in enumerate(hf_kv_absmax(path, calibration_prompt(llm)))}


def test_calculated_scales_are_the_unquantized_models_range(base, caplog):
    with caplog.at_level(logging.INFO, logger="deepbatch"):
        got, llm = calibrated(base[0])
    want_scales = expected_scales(base[0], llm)
    scales = layer_scales(llm)
    for layer, (k, v) in want_scales.items():
        assert scales[layer] == (pytest.approx(k, rel=1e-5), pytest.approx(v, rel=1e-5))
        assert llm.engine.runner.attn_layers[layer].kv_scale_source == "calibrated"
    # These K/V reach past 448: 1.0 would have saturated them, and the scales say so.
    assert all(k > 1.0 and v > 1.0 for k, v in scales.values())
    assert "calculate_kv_scales: k_scale" in caplog.text and "no k_scale/v_scale" not in caplog.text
    # The engine stores with the scales it measured, as HF reading the same round trip does.
    assert got == hf_greedy(base[0], PROMPTS, scales)
    assert got != hf_greedy(base[0], PROMPTS, UNIT)


def test_checkpoint_scales_win_and_only_bare_layers_are_measured(base, tmp_path, caplog):
    path = with_tensors(base, tmp_path / "partial", scale_tensors({0: SCALES[0]}))
    with caplog.at_level(logging.WARNING, logger="deepbatch"):
        got, llm = calibrated(path, PROMPTS[:2])
    scales, layers = layer_scales(llm), llm.engine.runner.attn_layers
    assert scales[0] == SCALES[0] and layers[0].kv_scale_source == "checkpoint"
    k, v = expected_scales(base[0], llm)[1]
    assert scales[1] == (pytest.approx(k, rel=1e-5), pytest.approx(v, rel=1e-5))
    assert layers[1].kv_scale_source == "calibrated"
    assert "k_scale/v_scale" not in caplog.text
    assert got == hf_greedy(base[0], PROMPTS[:2], scales)


def test_other_formats_ignore_calculate_kv_scales(base):
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(base[0], dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=True)
        assert layer_scales(llm) == UNIT
        assert all(a.kv_scale_source is None for a in llm.engine.runner.attn_layers)
