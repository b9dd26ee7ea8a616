"""DeepSeek-V2/V3 (MLA + DeepSeekMoE): greedy output is token-identical to HF transformers on the
same fp32 weights through batched prefill, prefix-cache hits and chunked prefill; the latent cache
holds only ``kv_lora_rank + qk_rope_head_dim`` values per token and layer; weights round-trip into
an HF model."""

from __future__ import annotations

import os

import pytest
import torch

from deepbatch import LLM, SamplingParams
from test_hf_parity import MAX_TOKENS, hf_greedy, make_prompts, ours, shared_prefix_prompts

TINY_DEEPSEEK = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    # Peaky logits keep greedy argmax away from near-ties between fp32 implementations.
    initializer_range=0.15,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    # YaRN with an mscale: the softmax scale picks up mscale**2, the rotary tables a factor.
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
)


def tiny_deepseek_config(arch: str):
    from transformers import DeepseekV2Config, DeepseekV3Config

    if arch == "v2":
        return DeepseekV2Config(**TINY_DEEPSEEK, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)
    if arch == "v3":
        return DeepseekV3Config(**TINY_DEEPSEEK, q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    raise ValueError(arch)


def build_deepseek_checkpoint(arch: str, path: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                # A correction bias of the size of the sigmoid scores changes which experts win.
                bias.copy_(torch.rand_like(bias) * 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Ops of models this small gain nothing from intra-op threads, which on a busy machine only
    spin: one thread for this module (HF and ours alike), restored afterwards."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def build_v3_mtp_checkpoint(root: str, seed: int = 3) -> tuple[str, dict, dict]:
    """A tiny V3 checkpoint with one MTP layer (``model.layers.{L}``: a whole decoder layer plus
    enorm/hnorm/eh_proj/shared_head, as DeepSeek ships it) at ``root/v3-mtp``; also every tensor
    written, and the MTP layer's own (not a decoder layer's) ones. ``root/deeper`` holds the
    transformers model of L + 1 layers whose last layer is the MTP layer's decoder layer."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    cfg = tiny_deepseek_config("v3")
    num_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    torch.manual_seed(seed)
    # One layer more than the config: transformers writes layer L's tensors with V3's own names.
    deeper = AutoModelForCausalLM.from_config(tiny_deepseek_config("v3").__class__(
        **{**cfg.to_dict(), "num_hidden_layers": num_layers + 1}), dtype=torch.float32)
    deeper.save_pretrained(os.path.join(root, "deeper"))
    tensors = {}
    for f in os.listdir(os.path.join(root, "deeper")):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(root, "deeper", f)))
    mtp = f"model.layers.{num_layers}."
    extra = {mtp + "enorm.weight": torch.rand(hidden) + 0.5, mtp + "hnorm.weight": torch.rand(hidden) + 0.5,
             mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.02,
             mtp + "shared_head.norm.weight": torch.rand(hidden) + 0.5,
             # The main model's embedding and head, which V3's MTP layers share.
             mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
             mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    tensors.update(extra)
    path = os.path.join(root, "v3-mtp")
    os.makedirs(path)
    cfg.num_nextn_predict_layers = 1
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path, tensors, extra


_HF_OUTPUTS: dict = {}


def hf_outputs(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """HF greedy outputs, computed once per checkpoint and prompt set (HF generate is the slow part)."""
    key = (path, tuple(map(tuple, prompts)))
    if key not in _HF_OUTPUTS:
        _HF_OUTPUTS[key] = hf_greedy(path, prompts)
    return _HF_OUTPUTS[key]


@pytest.fixture(scope="module")
def deepseek_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-deepseek")
    return {arch: build_deepseek_checkpoint(arch, str(root / arch)) for arch in ("v2", "v3")}


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_batched_greedy_matches_hf(deepseek_checkpoints, arch):
    path = deepseek_checkpoints[arch]
    prompts = make_prompts()
    got, llm = ours(path, prompts)
    assert got == hf_outputs(path, prompts)
    cfg = llm.engine.hf_config
    runner = llm.engine.runner
    # The latent cache: one [c_kv | k_pe] vector per token and layer, fp32.
    assert runner.kv_bytes_per_block() // runner.block_size == cfg.num_hidden_layers * (32 + 8) * 4


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_chunked_prefill_matches_hf(deepseek_checkpoints, arch):
    path = deepseek_checkpoints[arch]
    prompts = make_prompts()
    got, _ = ours(path, prompts, max_num_batched_tokens=16)
    assert got == hf_outputs(path, prompts)


def prefix_hit_outputs(path: str, **kwargs):
    """The shared-prefix prompts, the first alone so the others hit its blocks: greedy tokens of
    all, and the outputs of the others."""
    prompts = shared_prefix_prompts()
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=64, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + rest], rest


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_prefix_cache_hits_match_hf(deepseek_checkpoints, arch):
    path = deepseek_checkpoints[arch]
    got, rest = prefix_hit_outputs(path)
    assert got == hf_outputs(path, shared_prefix_prompts())
    assert all(o.num_cached_tokens > 0 for o in rest)


def test_triton_mla_path_matches_hf(deepseek_checkpoints):
    """The Triton MLA kernel wired into the model (through the interpreter on the CPU)."""
    pytest.importorskip("triton")
    path = deepseek_checkpoints["v3"]
    prompts = make_prompts()
    # Three prompts under a budget of 16: whole prompts, a chunked one, and decodes beside them.
    got, _ = ours(path, prompts[:3], attention_backend="triton", max_num_batched_tokens=16)
    assert got == hf_outputs(path, prompts)[:3]


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_export_weights_round_trip_into_hf(deepseek_checkpoints, arch):
    from transformers import AutoModelForCausalLM

    from deepbatch.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from deepbatch.models.loader import iter_safetensors

    path = deepseek_checkpoints[arch]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cls = DeepseekV2ForCausalLM if arch == "v2" else DeepseekV3ForCausalLM
    model = cls(reference.config, max_position=64)
    loaded = model.load_weights(iter_safetensors(path))
    assert loaded == {name for name, _ in model.named_parameters()}
    state = {}
    for name, p in model.named_parameters():
        state.update(model.export_weights(name, p.detach()))
    fresh = AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_v3_multi_token_prediction_layers_are_loaded_and_kept_out_of_normal_decoding(tmp_path):
    """A V3 checkpoint's MTP layer (``model.layers.{L}`` past the last decoder layer: a whole
    decoder layer plus enorm/hnorm/eh_proj/shared_head, as DeepSeek ships it) is loaded into
    ``model.mtp_layers`` with every tensor, while the outputs stay those of the L-layer model
    (transformers, which has no MTP module, ignores those tensors); only a drafter (method mtp,
    tests/engine/test_spec_mtp.py) runs it."""
    path, tensors, extra = build_v3_mtp_checkpoint(str(tmp_path))
    num_layers = tiny_deepseek_config("v3").num_hidden_layers
    mtp = f"model.layers.{num_layers}."
    prompts = make_prompts(n=3)
    got, llm = ours(str(path), prompts)
    assert got == hf_greedy(str(path), prompts)
    model = llm.engine.runner.model
    assert len(model.model.layers) == num_layers and len(model.model.mtp_layers) == 1
    kept = model.model.mtp_layers[0]
    torch.testing.assert_close(kept.eh_proj.weight, extra[mtp + "eh_proj.weight"])
    torch.testing.assert_close(kept.shared_head.norm.weight, extra[mtp + "shared_head.norm.weight"])
    torch.testing.assert_close(kept.mlp.experts.down_proj[0], tensors[mtp + "mlp.experts.0.down_proj.weight"])
    torch.testing.assert_close(kept.self_attn.kv_b_proj.weight, tensors[mtp + "self_attn.kv_b_proj.weight"])
    # Not attention layers of the model: no KV cache is bound for them.
    assert kept.self_attn not in model.attention_layers()
