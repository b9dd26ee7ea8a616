"""Sliding-window models against HF transformers (fp32 greedy, token for token): Mistral with a
window of 16 on every layer, Qwen2 windowing its upper layers (``use_sliding_window`` +
``max_window_layers``) or all of them, Qwen3 with an interleaved ``layer_types`` list; through
chunked prefill across the window's edge, prefix hits, preemption by recompute and by swap,
async scheduling and the Triton kernels (with CUDA-graph padding) under the interpreter.

Where every layer is windowed, the KV cache gives back the blocks behind the window: each
step's scheduled requests hold at most a window (plus the chunk) of blocks, read from the KV
accounting, while a run without the window holds every block of every sequence."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP
from hf_reference import hf_greedy_ids

MAX_TOKENS = 24
WINDOW = 16
LENGTHS = [5, 9, 15, 16, 17, 31, 40, 64, 77, 120]
TINY = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
SWAP_WINS = dict(swap_prefill_tokens_per_s=1.0, swap_host_link_bytes_per_s=1e15)


def tiny_config(name: str):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    if name == "mistral":
        return MistralConfig(**TINY, sliding_window=WINDOW)
    if name == "qwen2-upper":  # layer 0 full, layer 1 windowed
        return Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if name == "qwen2-all":
        return Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)
    if name == "qwen3-interleaved":  # windowed, full, windowed
        return Qwen3Config(**{**TINY, "num_hidden_layers": 3}, head_dim=32, use_sliding_window=True, sliding_window=12,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise ValueError(name)


EXPECTED_WINDOWS = {
    "mistral": [WINDOW, WINDOW], "qwen2-upper": [None, WINDOW], "qwen2-all": [WINDOW, WINDOW],
    "qwen3-interleaved": [12, None, 12],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-window")
    paths = {}
    for i, name in enumerate(EXPECTED_WINDOWS):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("bias"):
                    p.normal_(0.0, 0.1)
        model.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


_HF: dict = {}


def hf_greedy(path, prompts, max_tokens=MAX_TOKENS):
    from transformers import AutoModelForCausalLM

    key = (path, tuple(map(tuple, prompts)), max_tokens)
    if key not in _HF:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _HF[key] = hf_greedy_ids(model, prompts, max_tokens)
    return _HF[key]


def make_prompts(lengths=LENGTHS, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]


def shared_prefix_prompts():
    rng = random.Random(1)
    prefix = [rng.randrange(3, 384) for _ in range(50)]  # three full blocks of 16, past the window
    return [prefix + [rng.randrange(3, 384) for _ in range(k)] for k in (1, 5, 14, 20, 33)]


class HeldBlocks:
    """Spies on the scheduler: after each schedule, the blocks every scheduled request holds
    (``KVCacheManager.num_held_blocks``) against what its step reads, and the pool's used blocks."""

    def __init__(self, llm):
        self.kv = llm.engine.kv_cache
        sched = llm.engine.scheduler
        self.max_held = 0
        self.max_used = 0
        self.over: list = []
        schedule = sched.schedule

        def spy():
            out = schedule()
            bs, w = self.kv.block_size, self.kv.sliding_window
            for s in out.scheduled:
                held = self.kv.num_held_blocks(s.request)
                self.max_held = max(self.max_held, held)
                if w is not None and held > -(-(w - 1 + s.num_new_tokens + bs - 1) // bs):
                    self.over.append((s.request.request_id, s.request.num_computed_tokens, held))
            self.max_used = max(self.max_used, self.kv.stats(sched.running).used_blocks)
            return out

        sched.schedule = spy


def ours(path, prompts, max_tokens=MAX_TOKENS, spy=False, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", **kwargs)
    held = HeldBlocks(llm) if spy else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, held


def test_each_layer_gets_the_window_transformers_gives_it(checkpoints):
    for name, windows in EXPECTED_WINDOWS.items():
        llm = LLM(checkpoints[name], dtype="float32", device="cpu", num_gpu_blocks_override=64)
        assert [a.sliding_window for a in llm.engine.runner.attn_layers] == windows
        all_windowed = all(w is not None for w in windows)
        assert llm.engine.kv_cache.sliding_window == (max(windows) if all_windowed else None)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(), id="batched"),
        pytest.param(dict(max_num_batched_tokens=7, block_size=4), id="budget-7-crosses-the-window-edge"),
        pytest.param(dict(max_num_batched_tokens=20, block_size=8), id="budget-20-block-8"),
        pytest.param(dict(max_num_seqs=1, enable_prefix_caching=False), id="one-seat-no-prefix-cache"),
    ],
)
def test_mistral_matches_hf(checkpoints, kwargs):
    path = checkpoints["mistral"]
    prompts = make_prompts()
    got, llm, held = ours(path, prompts, spy=True, **kwargs)
    assert got == hf_greedy(path, prompts)
    # A 120-token prompt plus 24 tokens would fill 9 blocks of 16: the window keeps each step
    # to what it reads.
    assert llm.engine.kv_cache.sliding_window == WINDOW
    assert held.over == []
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_memory_follows_the_window_and_not_the_sequence(checkpoints):
    path = checkpoints["mistral"]
    prompts = make_prompts([100, 120])
    kw = dict(block_size=4, max_num_batched_tokens=8, max_tokens=60, spy=True)
    windowed, _, held = ours(path, prompts, **kw)
    assert windowed == hf_greedy(path, prompts, 60)
    # Keys of one step span at most 16 - 1 + 8 tokens: 7 blocks of 4; 180 tokens would take 45.
    assert held.over == [] and held.max_held <= 7
    assert held.max_used <= 2 * 7


def test_mistral_prefix_hits_past_the_window_match_hf(checkpoints):
    path = checkpoints["mistral"]
    prompts = shared_prefix_prompts()
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=64)
    held = HeldBlocks(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(path, prompts)
    # The three full prefix blocks were published before they slid out, and stayed cached.
    assert all(o.num_cached_tokens == 48 for o in rest)
    assert llm.engine.kv_cache.sliding_window == WINDOW and held.over == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mistral_preemption_by_recompute_and_swap_matches_hf(checkpoints, async_scheduling):
    path = checkpoints["mistral"]
    prompts = make_prompts()
    want = hf_greedy(path, prompts)

    def generate(swap_space, rates):
        # 16 blocks of 4: a step reads at most (15 + 16 + 3) / 4 = 9 blocks, so each request fits
        # alone; ten running together need about five each.
        config = EngineConfig(
            model=ModelConfig(path, torch.float32, 512),
            cache=CacheConfig(block_size=4, num_gpu_blocks_override=16, swap_space=swap_space, **rates),
            scheduler=SchedulerConfig(max_num_seqs=10, max_num_batched_tokens=16),
            device="cpu",
            async_scheduling=async_scheduling,
        )
        llm = LLM.from_config(config)
        held = HeldBlocks(llm)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.kv_cache.sliding_window == WINDOW and held.over == []
        assert llm.engine.kv_cache.pool.num_free_blocks == 16
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.preemptor.num_preemptions_by_mode

    recomputed, modes = generate(0.0, {})
    assert modes[RECOMPUTE] > 0 and recomputed == want
    swapped, modes = generate(1 / 1024, SWAP_WINS)
    assert modes[SWAP] > 0 and swapped == want


@pytest.mark.parametrize("name", ["qwen2-upper", "qwen2-all", "qwen3-interleaved"])
@pytest.mark.parametrize("kwargs", [dict(), dict(max_num_batched_tokens=7, block_size=4)], ids=["batched", "budget-7"])
def test_qwen_windowed_layers_match_hf(checkpoints, name, kwargs):
    path = checkpoints[name]
    prompts = make_prompts()
    got, llm, held = ours(path, prompts, spy=True, **kwargs)
    assert got == hf_greedy(path, prompts)
    if name == "qwen2-all":
        assert llm.engine.kv_cache.sliding_window == WINDOW and held.over == []
    else:  # a full-attention layer needs every block: nothing is released
        assert llm.engine.kv_cache.sliding_window is None
        assert held.max_held == -(-(120 + MAX_TOKENS - 1) // llm.engine.kv_cache.block_size)


def test_qwen2_mixed_windows_with_prefix_hits_and_preemption_match_hf(checkpoints):
    path = checkpoints["qwen2-upper"]
    prompts = shared_prefix_prompts()
    got, llm, _ = ours(path, prompts, num_gpu_blocks_override=12, max_num_seqs=5, max_num_batched_tokens=32)
    assert got == hf_greedy(path, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.num_hit_tokens > 0


def test_triton_kernels_with_cuda_graph_padding_match_hf(checkpoints):
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runner"))
    from test_cuda_graph import _eager_replay_graphs

    path = checkpoints["mistral"]
    # Chunks of 24 and decodes past the window; each step's keys start mid-block.
    prompts = make_prompts([5, 30, 45])
    common = dict(dtype="float32", device="cpu", attention_backend="triton", max_num_seqs=4, block_size=8,
                  max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = hf_greedy(path, prompts, 6)
    eager = LLM(path, **common)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in eager.generate(inputs, params, use_tqdm=False)] == want
    del eager
    llm = LLM(path, **common)
    runner = llm.engine.runner
    runner.graphs = _eager_replay_graphs(runner, 4, 24)
    assert [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)] == want
    assert runner.graphs.decode.replays  # steps went through the padded graph buffers
