"""An 8-bit MLA latent cache (DeepSeek-V2/V3, ``kv_cache_dtype`` fp8/int8): greedy output is
token-identical to HF transformers on the same fp32 weights whose attention expands its cached
latents after the same quantize-dequantize round trip, written here from the formats' definitions
(not with the engine's code): one scale per token for ``c_kv`` and one for ``k_pe``, int8 keeping
``round(x / (absmax / 127))`` and fp8 ``x / (absmax / fp8_max)`` rounded to the format. Prefix-cache
hits, chunked prefill (expanded and absorbed), swap and the Triton kernels read the quantized
blocks with the same result; the KV accounting counts the latent's bytes and its scales."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepbatch import LLM, SamplingParams
from hf_reference import hf_greedy_ids
from test_deepseek import build_deepseek_checkpoint, one_thread  # noqa: F401  (one_thread: autouse fixture)

MAX_TOKENS = 12
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
STORAGE = {"int8": torch.int8, **FP8}
RANK, ROPE = 32, 8  # test_deepseek's tiny config


def round_trip(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """Each vector of ``x [..., D]`` as an 8-bit latent cache with a per-token scale gives it back."""
    limit = 127.0 if kv_cache_dtype == "int8" else torch.finfo(FP8[kv_cache_dtype]).max
    scale = x.abs().amax(-1, keepdim=True) / limit
    y = x / torch.where(scale > 0, scale, 1.0)
    q = torch.round(y).clamp(-127, 127) if kv_cache_dtype == "int8" else y.clamp(-limit, limit).to(FP8[kv_cache_dtype])
    return q.to(x.dtype) * scale


_HF: dict = {}


def hf_greedy(path: str, prompts, kv_cache_dtype: str, max_tokens: int = MAX_TOKENS):
    """HF transformers keeps the latents ``c_kv`` and rotated ``k_pe`` in its cache and expands all
    of them every step (``expand_kv``); the round trip is a pure function of each token's two
    vectors, so passing them through it there equals storing them once."""
    from transformers import AutoModelForCausalLM

    key = (path, kv_cache_dtype)
    if key not in _HF:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if kv_cache_dtype != "auto":
            for layer in model.model.layers:
                attn = layer.self_attn
                expand = attn.expand_kv
                attn.expand_kv = lambda kv_nope, k_rot, expand=expand: expand(round_trip(kv_nope, kv_cache_dtype),
                                                                              round_trip(k_rot, kv_cache_dtype))
        _HF[key] = model
    return hf_greedy_ids(_HF[key], prompts, max_tokens)


def ours(path: str, prompts, kv_cache_dtype: str, max_tokens: int = MAX_TOKENS, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def make_prompts(seed=0, lengths=(3, 17, 40, 77, 9, 25)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]


def shared_prefix_prompts():
    rng = random.Random(1)
    prefix = [rng.randrange(3, 384) for _ in range(50)]
    return [prefix + [rng.randrange(3, 384) for _ in range(k)] for k in (1, 14, 33, 9)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-deepseek-kv")
    return {arch: build_deepseek_checkpoint(arch, str(root / arch)) for arch in ("v2", "v3")}


@pytest.mark.parametrize("arch, kv_cache_dtype", [("v2", "int8"), ("v2", "fp8"), ("v2", "fp8_e5m2"), ("v3", "int8"),
                                                   ("v3", "fp8")])
def test_greedy_matches_hf_reading_the_same_round_trip(checkpoints, arch, kv_cache_dtype):
    path = checkpoints[arch]
    prompts = make_prompts() + shared_prefix_prompts()
    want = hf_greedy(path, prompts, kv_cache_dtype)
    got, llm = ours(path, prompts, kv_cache_dtype)
    assert got == want
    latent, scale = llm.engine.runner.kv_caches[0]
    assert latent.dtype == STORAGE[kv_cache_dtype] and latent.shape[2:] == (1, RANK + ROPE)
    assert scale.dtype == torch.float32 and scale.shape == (*latent.shape[:2], 2)
    # The round trip moves these tiny models' greedy path for some prompt, so the match above is
    # not one that a full-precision cache would pass too.
    assert want != hf_greedy(path, prompts, "auto")


@pytest.mark.parametrize("mla_prefill", ["expanded", "absorbed"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_prefix_hits_and_chunked_prefill_read_the_quantized_blocks(checkpoints, kv_cache_dtype, mla_prefill):
    """The later prompts hit the first one's blocks (the cached context of their chunks read
    quantized, by the absorbed kernel) and are cut into chunks of at most 16 tokens."""
    path = checkpoints["v2"]
    prompts = shared_prefix_prompts()
    want = hf_greedy(path, prompts, kv_cache_dtype)
    assert want != hf_greedy(path, prompts, "auto")
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype, block_size=8,
              max_num_batched_tokens=16, mla_prefill=mla_prefill)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert all(o.num_cached_tokens >= 48 for o in rest)


def test_triton_kernels_match_hf(checkpoints):
    """The Triton write and absorbed kernels (the interpreter on the CPU) beside expanded chunks.
    int8: the interpreter's fp32 -> fp8 conversion truncates, so its fp8 writes differ from the
    reference's rounding (tests/kernels/test_mla_kv_quant.py checks them)."""
    pytest.importorskip("triton")
    path = checkpoints["v3"]
    prompts = make_prompts()[:3]
    got, _ = ours(path, prompts, "int8", attention_backend="triton", max_num_batched_tokens=16)
    want = hf_greedy(path, prompts, "int8")
    assert got == want and want != hf_greedy(path, prompts, "auto")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_swap_preemption_moves_the_scales(checkpoints, kv_cache_dtype):
    """Preemption by swap on 20 blocks of 4 tokens gives the outputs of a run that never preempts:
    the blocks come back with their scales (the blocks a swap-out frees are rewritten by other
    requests, so a swap that left the scales behind fails this)."""
    from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from deepbatch.scheduler.preemption import SWAP

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (5 + 5 * i,), generator=g).tolist() for i in range(6)]

    def generate(num_blocks, swap_space=0.0, rates=None):
        config = EngineConfig(
            model=ModelConfig(checkpoints["v2"], torch.float32, 256),
            cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks, swap_space=swap_space,
                              kv_cache_dtype=kv_cache_dtype, **(rates or {})),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), device="cpu")
        llm = LLM.from_config(config)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine

    reference, _ = generate(None)
    swapped, engine = generate(20, 1 / 1024, dict(swap_prefill_tokens_per_s=1.0, swap_host_link_bytes_per_s=1e15))
    assert engine.scheduler.preemptor.num_preemptions_by_mode[SWAP] > 0
    assert [t.dtype for t in engine.runner.host_kv.caches[0]] == [STORAGE[kv_cache_dtype], torch.float32]
    assert swapped == reference


def test_tensor_parallel_ranks_share_the_replicated_8bit_latent(checkpoints):
    """TP=2 (two processes over gloo): each rank keeps the whole latent cache with its scales and
    attends with its half of the heads; chunks over cached context beside decodes."""
    path = checkpoints["v2"]
    prompts = make_prompts()
    want = hf_greedy(path, prompts, "fp8")
    got, llm = ours(path, prompts, "fp8", tensor_parallel_size=2, distributed_timeout_s=30,
                    max_num_batched_tokens=16)
    try:
        assert got == want and want != hf_greedy(path, prompts, "auto")
    finally:
        llm.engine.shutdown()


# -- one layer: the expanded prefill reads the step's latents as cached ------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_expanded_matches_absorbed_on_an_8bit_cache(kv_cache_dtype, backend):
    """Chunks attend to their own new tokens expanded and to their cached context absorbed: both
    halves see the dequantized latents, so the layer gives the all-absorbed output (which reads
    every key from the cache), well within the 8-bit error that full-precision new tokens would
    leave."""
    if backend == "triton":
        pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))
    from test_mla import ORDERS, _layer, _mixed_batch

    from deepbatch.layers.attention import make_backend

    config, layer, rope = _layer("v3")
    num_blocks, block_size = 64, 4
    specs = layer.cache_specs(STORAGE[kv_cache_dtype])
    caches = [torch.zeros((num_blocks, block_size, *shape), dtype=dtype) for shape, dtype in specs]
    layer.bind(caches, make_backend(backend))
    batch = _mixed_batch(ORDERS["chunks-among-decodes"], num_blocks)
    x = torch.randn(batch.num_tokens, config.hidden_size) * 3
    at = rope.at(batch.positions)
    with torch.no_grad():
        layer.prefill_mode = "absorbed"
        want = layer(x, at, batch)  # writes every new latent; rewriting them below is idempotent
        layer.prefill_mode = "expanded"
        got = layer(x, at, batch)
        # The same step over a full-precision cache: what the 8-bit one changes.
        layer.bind([torch.zeros((num_blocks, block_size, 1, RANK + ROPE))], make_backend(backend))
        layer.prefill_mode = "absorbed"
        full = layer(x, at, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (full - want).abs().max() > 1e-3


# -- the accounting ----------------------------------------------------------------------------


def test_capacity_counts_the_latent_and_its_scales(checkpoints, caplog):
    import logging

    from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    engines = {}
    with caplog.at_level(logging.INFO, logger="deepbatch.runner.model_runner"):
        for kv in ("auto", "fp8", "int8"):
            config = EngineConfig(ModelConfig(checkpoints["v2"], torch.float32, 256),
                                  CacheConfig(block_size=4, cpu_kv_cache_bytes=60 << 10, kv_cache_dtype=kv),
                                  SchedulerConfig(), device="cpu")
            engines[kv] = LLM.from_config(config).engine
    # 3 layers x (32 + 8) latent values per token, 4 tokens a block: 4 bytes each at fp32, 1 plus
    # two float32 scales per token at fp8 and int8.
    per_block = {kv: e.runner.kv_bytes_per_block() for kv, e in engines.items()}
    assert per_block == {"auto": 4 * 3 * 40 * 4, "fp8": 4 * 3 * (40 + 8), "int8": 4 * 3 * (40 + 8)}
    assert {kv: e.num_blocks for kv, e in engines.items()} == {"auto": 32, "fp8": 106, "int8": 106}
    assert "kv_cache_dtype int8 (int8, float32 scales per token for c_kv and k_pe), 0.14 KiB per token" in caplog.text
    assert "kv_cache_dtype fp8 (float8_e4m3fn, float32 scales per token for c_kv and k_pe)" in caplog.text
    assert "k_scale" not in caplog.text  # per-token scales: no checkpoint scales to miss


def test_doctor_and_roofline_count_the_8bit_latent(checkpoints):
    from deepbatch import doctor
    from deepbatch.bench.roofline import model_cost
    from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    config = EngineConfig(ModelConfig(checkpoints["v3"], torch.float32, None),
                          CacheConfig(cpu_kv_cache_bytes=1 << 20, kv_cache_dtype="fp8"), SchedulerConfig(), device="cpu")
    kv = doctor.kv_capacity(config)
    # Per token: 3 layers x 40 latent values, 4 bytes each (fp32), 1 + 8 bytes of scales (8-bit).
    assert {k: v["kv_bytes_per_token"] for k, v in kv["per_dtype"].items()} == {"fp8": 144, "auto": 480, "int8": 144}
    assert kv["kv_capacity_tokens"] == (1 << 20) // 144
    # DeepSeek-V2-Lite's shapes in bf16: 27 layers x 576 latent values, 2 bytes against 1 + 8.
    lite = type("Cfg", (), dict(hidden_size=2048, num_hidden_layers=27, vocab_size=102400, num_attention_heads=16,
                                kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                q_lora_rank=None, intermediate_size=10944, n_routed_experts=64,
                                first_k_dense_replace=1, moe_intermediate_size=1408, n_shared_experts=2,
                                num_experts_per_tok=6))()
    assert model_cost(lite, 2).kv_bytes_per_token == 27 * 576 * 2
    for name in ("fp8", "fp8_e5m2", "int8"):
        assert model_cost(lite, 2, name).kv_bytes_per_token == 27 * (576 + 8)


def test_checkpoint_kv_scales_are_accepted_and_unused(checkpoints, tmp_path):
    """A DeepSeek checkpoint carrying per-layer ``self_attn.k_scale``/``v_scale`` (what an fp8 MHA
    cache would read) loads: the latent cache scales each token itself, so they change nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "v2-scales"
    shutil.copytree(checkpoints["v2"], path)
    files = sorted(path.glob("*.safetensors"))
    tensors = load_file(str(files[0]))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, str(files[0]))
    prompts = make_prompts()[:3]
    got, _ = ours(str(path), prompts, "fp8")
    want, _ = ours(checkpoints["v2"], prompts, "fp8")
    assert got == want
