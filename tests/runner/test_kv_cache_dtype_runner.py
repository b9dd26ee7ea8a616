"""The runner with an 8-bit KV cache: everything that moves or reads blocks keeps the quantized
blocks and their scales together. Swap-out/in (preemption) gives the tokens of a run that never
preempts; the host pool copies every cache tensor, fp8 and int8 blocks and the int8 scales; the
Triton backend, through CUDA-graph padding, gives the tokens of the torch backend (on the CPU
through the interpreter, int8 only: the interpreter's fp32-to-fp8 conversion is not the GPU's, so
fp8 through Triton is compared on a GPU)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepbatch.runner.kv_swap import HostKVCache
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP

sys.path.insert(0, str(Path(__file__).resolve().parent))
SWAP_WINS = dict(swap_prefill_tokens_per_s=1.0, swap_host_link_bytes_per_s=1e15)
ON_GPU = torch.cuda.is_available()


def prompts(n=6, vocab=384):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (5 + 5 * i,), generator=g).tolist() for i in range(n)]


def generate(path, kv_cache_dtype, num_blocks=None, swap_space=0.0, rates=None, **engine):
    config = EngineConfig(
        model=ModelConfig(path, torch.float32, 256),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks, swap_space=swap_space,
                          kv_cache_dtype=kv_cache_dtype, **(rates or {})),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device="cpu", **engine,
    )
    llm = LLM.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_swap_preemption_keeps_quantized_blocks_and_scales(tiny_checkpoints, kv_cache_dtype):
    path = tiny_checkpoints["llama"]
    reference, llm = generate(path, kv_cache_dtype)
    assert llm.engine.scheduler.preemptor.num_preemptions_by_mode == {SWAP: 0, RECOMPUTE: 0}
    # 20 blocks of 4 tokens: the longest request (30 + 24 tokens) fits alone; all six need ~60.
    swapped, llm = generate(path, kv_cache_dtype, 20, swap_space=1 / 1024, rates=SWAP_WINS)
    assert llm.engine.scheduler.preemptor.num_preemptions_by_mode[SWAP] > 0
    assert swapped == reference
    host = llm.engine.runner.host_kv.caches[0]
    assert [t.dtype for t in host] == [t.dtype for t in llm.engine.runner.kv_caches[0]]


def test_host_pool_copies_fp8_int8_and_scale_tensors():
    g = torch.Generator().manual_seed(0)
    fp8 = [torch.randn(8, 2, 2, 16, generator=g).to(torch.float8_e4m3fn) for _ in range(2)]
    int8 = [torch.randint(-127, 128, (8, 2, 2, 16), generator=g, dtype=torch.int8) for _ in range(2)]
    int8 += [torch.rand(8, 2, 2, generator=g) for _ in range(2)]  # the int8 layer's scales
    device = [fp8, int8]
    before = [[t.clone() for t in layer] for layer in device]
    host = HostKVCache(device, 4)
    host.copy(device, swap_out=[(6, 0), (1, 3)], swap_in=[])
    host.copy(device, swap_out=[], swap_in=[(3, 6), (0, 2)])
    for layer, orig, hlayer in zip(device, before, host.caches):
        for d, t, h in zip(layer, orig, hlayer):
            assert h.dtype == t.dtype
            bits = (lambda x: x.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (lambda x: x)
            assert torch.equal(bits(h[0]), bits(t[6])) and torch.equal(bits(h[3]), bits(t[1]))
            assert torch.equal(bits(d[6]), bits(t[1])) and torch.equal(bits(d[2]), bits(t[6]))


@pytest.mark.skipif(ON_GPU, reason="the interpreter path; a GPU runs test_gpu_triton_matches_torch_backend")
def test_triton_backend_through_graph_padding_matches_torch_backend_int8(tiny_checkpoints):
    pytest.importorskip("triton")
    from test_cuda_graph import _eager_replay_graphs

    rng = random.Random(0)
    ps = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 23, 37, 50, 9, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=40, kv_cache_dtype="int8")
    torch_llm = LLM(tiny_checkpoints["qwen3"], attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in torch_llm.generate(ps, params, use_tqdm=False)]
    llm = LLM(tiny_checkpoints["qwen3"], attention_backend="triton", **common)
    runner = llm.engine.runner
    runner.graphs = _eager_replay_graphs(runner, 4, 40)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == want
    assert any(size > real for _, size, real in runner.graphs.decode.replays)  # padded steps ran


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_gpu_triton_with_cuda_graphs_matches_torch_backend(tiny_checkpoints, kv_cache_dtype):
    rng = random.Random(0)
    ps = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 23, 37, 50, 9, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    common = dict(dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=40,
                  kv_cache_dtype=kv_cache_dtype, async_scheduling=False)
    out = {}
    for name, kw in (("torch", dict(attention_backend="torch", enforce_eager=True)),
                     ("triton-graphs", dict(attention_backend="triton"))):
        llm = LLM(tiny_checkpoints["qwen3"], **common, **kw)
        if name == "triton-graphs":
            assert llm.engine.runner.graphs is not None
        out[name] = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert out["triton-graphs"] == out["torch"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_tensor_parallel_ranks_keep_their_heads_quantized(tiny_checkpoints, kv_cache_dtype):
    # llama tiny: 2 KV heads, one per rank: each rank's cache (and int8 scales) holds half.
    ps = [{"prompt_token_ids": [5 + i * 3 + j for j in range(10 + 7 * i)]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out, per_block = {}, {}
    for tp in (1, 2):
        llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype,
                  tensor_parallel_size=tp, distributed_timeout_s=30, max_num_batched_tokens=32)
        try:
            out[tp] = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
            per_block[tp] = llm.engine.runner.kv_bytes_per_block()
        finally:
            llm.engine.shutdown()
    assert out[2] == out[1]
    assert per_block[2] * 2 == per_block[1]
