"""Preemption on a real model: greedy outputs with preemption by swap and by recompute are
identical to a run that never preempts (Llama-style K/V caches and DeepSeek's MLA latent cache,
with and without async scheduling), and the host pool's block copies move every layer's every
cache tensor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepbatch.runner.kv_swap import HostKVCache
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP

# The tiny DeepSeek checkpoint builder lives with the model tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_deepseek import build_deepseek_checkpoint  # noqa: E402

MAX_TOKENS = 24
SWAP_WINS = dict(swap_prefill_tokens_per_s=1.0, swap_host_link_bytes_per_s=1e15)
RECOMPUTE_WINS = dict(swap_prefill_tokens_per_s=1e15, swap_host_link_bytes_per_s=1.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory):
    return build_deepseek_checkpoint("v2", str(tmp_path_factory.mktemp("tiny-deepseek") / "v2"))


def prompts(n=6, vocab=384):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (5 + 5 * i,), generator=g).tolist() for i in range(n)]


def generate(path: str, num_blocks: int | None, swap_space: float = 0.0, rates: dict | None = None,
             async_scheduling: bool = False):
    config = EngineConfig(
        model=ModelConfig(path, torch.float32, 256),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks, swap_space=swap_space, **(rates or {})),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device="cpu",
        async_scheduling=async_scheduling,
    )
    llm = LLM.from_config(config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    sched = llm.engine.scheduler
    return [o.outputs[0].token_ids for o in outs], sched.preemptor.num_preemptions_by_mode


@pytest.mark.parametrize("arch, async_scheduling", [("llama", False), ("mla", False), ("llama", True)])
def test_greedy_output_is_the_same_with_swap_and_recompute_preemption(tiny_checkpoints, mla_checkpoint, arch,
                                                                       async_scheduling):
    path = mla_checkpoint if arch == "mla" else tiny_checkpoints["llama"]
    # 20 blocks of 4 tokens: the longest request (30 + 24 tokens) fits alone; all six need ~60.
    reference, modes = generate(path, None)
    assert modes == {SWAP: 0, RECOMPUTE: 0}
    swapped, modes = generate(path, 20, swap_space=1 / 1024, rates=SWAP_WINS, async_scheduling=async_scheduling)
    assert modes[SWAP] > 0
    assert swapped == reference
    recomputed, modes = generate(path, 20, swap_space=1 / 1024, rates=RECOMPUTE_WINS, async_scheduling=async_scheduling)
    assert modes[RECOMPUTE] > 0 and modes[SWAP] == 0
    assert recomputed == reference


def test_host_copies_move_every_cache_tensor_of_every_layer():
    # One standard-attention layer (K and V) and one MLA layer (one latent tensor), 8 blocks of 2.
    g = torch.Generator().manual_seed(0)
    device = [[torch.randn(8, 2, 2, 3, generator=g), torch.randn(8, 2, 2, 3, generator=g)],
              [torch.randn(8, 2, 5, generator=g)]]
    before = [[t.clone() for t in layer] for layer in device]
    host = HostKVCache(device, 4)
    host.copy(device, swap_out=[(6, 0), (1, 3)], swap_in=[])
    for layer, orig in zip(host.caches, before):
        for h, t in zip(layer, orig):
            assert torch.equal(h[0], t[6]) and torch.equal(h[3], t[1])
    # Swap-outs run before swap-ins: block 6 is read out before slot 3 is written into it.
    host.copy(device, swap_out=[(2, 1)], swap_in=[(3, 6), (0, 2)])
    for layer, orig in zip(device, before):
        for d, t in zip(layer, orig):
            assert torch.equal(d[6], t[1]) and torch.equal(d[2], t[6])
    for layer, orig in zip(host.caches, before):
        for h, t in zip(layer, orig):
            assert torch.equal(h[1], t[2])


def test_a_swap_space_over_the_cgroup_limit_is_refused(tiny_checkpoints, tmp_path, monkeypatch):
    from deepbatch.kv_cache import host_memory

    (tmp_path / "memory.max").write_text(str(64 << 20))
    (tmp_path / "memory.current").write_text(str(32 << 20))
    real = host_memory.cgroup_memory
    monkeypatch.setattr(host_memory, "cgroup_memory", lambda root=str(tmp_path): real(root))
    with pytest.raises(ValueError, match="cgroup v2 memory limit"):
        generate(tiny_checkpoints["llama"], 20, swap_space=0.25, rates=SWAP_WINS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduler=SchedulerConfig(preemption_mode="swap")), "preemption_mode: 'swap' needs a swap space"),
])
def test_contradictory_settings_are_refused(kwargs, message):
    base = dict(model=ModelConfig("m", torch.float32, 256), cache=CacheConfig(), scheduler=SchedulerConfig())
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{**base, **kwargs})
