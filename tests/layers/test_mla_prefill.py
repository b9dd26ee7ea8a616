"""The expanded MLA prefill (``mla_prefill="expanded"``): prefill chunks attend over keys and values
decompressed by ``kv_b_proj``, decodes beside them stay absorbed. Greedy output is token-identical
to HF transformers through chunked prefill and prefix-cache hits; one layer gives the absorbed
path's output on a mixed batch; decode steps still replay their graphs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import deepbatch.kernels.mla_decode as mla_decode
import deepbatch.layers.mla as mla
from deepbatch import LLM, SamplingParams
from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepbatch.layers.attention import make_backend
from deepbatch.layers.mla import MLARotaryEmbedding, MultiHeadLatentAttention, causal_attention
from deepbatch.runner.forward_batch import ForwardBatch

# The tiny DeepSeek checkpoints and the HF reference helpers live beside the model tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_deepseek import (deepseek_checkpoints, hf_outputs, one_thread, prefix_hit_outputs,  # noqa: E402,F401
                           tiny_deepseek_config)
from test_hf_parity import make_prompts, ours, shared_prefix_prompts  # noqa: E402


class PathLog:
    """What each path computed: ``(q_len, seq_len)`` of every request attended expanded, and the
    q_len of every request the absorbed attention computed."""

    def __init__(self, monkeypatch):
        self.expanded: list[tuple[int, int]] = []
        self.absorbed: list[int] = []
        expanded, ref, triton = mla.causal_attention, mla.mla_attention_ref, mla_decode.mla_attention

        def log_expanded(query, key, *args, **kwargs):
            self.expanded.append((query.shape[0], key.shape[0]))
            return expanded(query, key, *args, **kwargs)

        def absorbed(fn):
            def log(q_latent, q_pe, cache, tables, query_start_loc, *args, max_q_len=None, **kwargs):
                qsl = query_start_loc.tolist()
                self.absorbed += [b - a for a, b in zip(qsl, qsl[1:]) if 0 < b - a <= (max_q_len or b - a)]
                return fn(q_latent, q_pe, cache, tables, query_start_loc, *args, max_q_len=max_q_len, **kwargs)
            return log

        monkeypatch.setattr(mla, "causal_attention", log_expanded)
        monkeypatch.setattr(mla, "mla_attention_ref", absorbed(ref))
        monkeypatch.setattr(mla_decode, "mla_attention", absorbed(triton))

    def assert_split(self):
        """Chunks, some over cached context, went expanded; the absorbed path saw decodes only."""
        assert self.expanded and all(q > 1 for q, _ in self.expanded)
        assert any(q < s for q, s in self.expanded)
        assert self.absorbed and set(self.absorbed) == {1}


# -- token parity with HF transformers ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_chunked_prefill_matches_hf(deepseek_checkpoints, arch, monkeypatch):
    path = deepseek_checkpoints[arch]
    prompts = make_prompts()
    log = PathLog(monkeypatch)
    got, llm = ours(path, prompts, max_num_batched_tokens=16, mla_prefill="expanded")
    assert got == hf_outputs(path, prompts)
    assert all(a.prefill_mode == "expanded" for a in llm.engine.runner.attn_layers)
    log.assert_split()


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_prefix_cache_hits_match_hf(deepseek_checkpoints, arch, monkeypatch):
    path = deepseek_checkpoints[arch]
    log = PathLog(monkeypatch)
    got, rest = prefix_hit_outputs(path, mla_prefill="expanded")
    assert got == hf_outputs(path, shared_prefix_prompts())
    assert all(o.num_cached_tokens > 0 for o in rest)
    # Every hit's chunk attends over the cached prefix (the one-token one is absorbed).
    hits = sum(1 for q, s in log.expanded if s > q and s >= 50)
    assert hits >= len(rest) - 1
    log.assert_split()


def test_triton_decodes_beside_expanded_chunks_match_hf(deepseek_checkpoints, monkeypatch):
    """The Triton absorbed kernel (interpreter on the CPU) skipping the chunks' rows."""
    pytest.importorskip("triton")
    path = deepseek_checkpoints["v3"]
    prompts = make_prompts()[:3]
    log = PathLog(monkeypatch)
    got, _ = ours(path, prompts, attention_backend="triton", max_num_batched_tokens=16, mla_prefill="expanded")
    assert got == hf_outputs(path, make_prompts())[:3]
    log.assert_split()


# -- one layer: expanded against absorbed ------------------------------------------------------

BLOCK_SIZE = 4
# (q_len, seq_len): fresh prompts, decodes (one a one-token prompt), a chunk over cached context
# that starts and ends mid-block. Two orders: decodes first, and chunks between decodes. The 28
# tokens make two groups of chunks decompressed together ([3, 18, 2] and [6, 9] cached tokens).
ORDERS = {
    "decodes-first": [(1, 13), (1, 1), (1, 30), (3, 3), (5, 18), (2, 2), (6, 6), (9, 9)],
    "chunks-among-decodes": [(3, 3), (1, 13), (5, 18), (2, 2), (1, 1), (6, 6), (1, 30), (9, 9)],
}


def _layer(arch: str):
    config = tiny_deepseek_config(arch)
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(config)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.fill_(1.0) if "layernorm" in name else p.normal_(0.0, 0.15)
    rope = MLARotaryEmbedding(config, config.qk_rope_head_dim, config.max_position_embeddings, arch == "v2")
    return config, layer, rope


def _mixed_batch(lens, num_blocks: int) -> ForwardBatch:
    """Shuffled, non-contiguous blocks; the new tokens' slots are the last q_len of each request."""
    width = max(-(-s // BLOCK_SIZE) for _, s in lens)
    ids = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width)
    positions, slots, qsl = [], [], [0]
    for i, (q, s) in enumerate(lens):
        pos = torch.arange(s - q, s)
        positions.append(pos)
        slots.append(ids[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + q)
    q_lens, seq_lens = [q for q, _ in lens], [s for _, s in lens]
    return ForwardBatch(
        input_ids=torch.zeros(qsl[-1], dtype=torch.long),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=ids.to(torch.int32),
        logits_indices=torch.tensor([qsl[-1] - 1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_expanded_matches_absorbed(arch, order, backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    config, layer, rope = _layer(arch)
    lens = ORDERS[order]
    num_blocks = 64
    cache = torch.randn(num_blocks, BLOCK_SIZE, 1, config.kv_lora_rank + config.qk_rope_head_dim)
    layer.bind([cache], make_backend(backend))
    batch = _mixed_batch(lens, num_blocks)
    x = torch.randn(batch.num_tokens, config.hidden_size)
    at = rope.at(batch.positions)

    with torch.no_grad():
        want = layer(x, at, batch)  # absorbed; rewriting the same latents later changes nothing
        log = PathLog(monkeypatch)
        layer.prefill_mode = "expanded"
        gemms = []
        hook = layer.kv_b_proj.register_forward_hook(lambda mod, args, out: gemms.append(args[0].shape[0]))
        got = layer(x, at, batch)
        hook.remove()
        # Without host copies the lengths are read from the device: the same rows.
        again = layer(x, at, dataclasses.replace(batch, query_lens_cpu=None, seq_lens_cpu=None))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, got, atol=0, rtol=0)
    chunks = [(q, s) for q, s in lens if q > 1]
    assert sorted(log.expanded) == sorted(chunks * 2)
    assert log.absorbed == [1] * (2 * sum(q == 1 for q, _ in lens))
    assert gemms == [BLOCK_SIZE * 7, BLOCK_SIZE * 5]  # whole blocks of each group's requests


def test_expanded_decode_only_step_stays_absorbed(monkeypatch):
    config, layer, rope = _layer("v3")
    cache = torch.randn(64, BLOCK_SIZE, 1, config.kv_lora_rank + config.qk_rope_head_dim)
    layer.bind([cache], make_backend("torch"))
    layer.prefill_mode = "expanded"
    batch = _mixed_batch([(1, 13), (1, 30)], 64)
    log = PathLog(monkeypatch)
    with torch.no_grad():
        layer(torch.randn(2, config.hidden_size), rope.at(batch.positions), batch)
    assert log.expanded == [] and log.absorbed == [1, 1]


@pytest.mark.parametrize("q_len,seq_len", [(9, 9), (4, 11), (1, 6)])
def test_causal_attention_padded_values(q_len, seq_len):
    """Row j sees keys 0 .. seq_len - q_len + j, with or without zero-padded values."""
    torch.manual_seed(1)
    heads, dq, dv = 3, 24, 16
    q, k, v = torch.randn(q_len, heads, dq), torch.randn(seq_len, heads, dq), torch.randn(seq_len, heads, dv)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    for pad in (False, True):
        torch.testing.assert_close(causal_attention(q, k, v, 0.3, pad_value=pad), want, atol=1e-5, rtol=1e-5)


# -- configuration and CUDA graphs -------------------------------------------------------------


def test_bad_mla_prefill_raises():
    model = ModelConfig(None, torch.float32, None)
    with pytest.raises(ValueError, match="mla_prefill"):
        EngineConfig(model, CacheConfig(), SchedulerConfig(), mla_prefill="decompressed")
    with pytest.raises(ValueError, match="mla_prefill"):
        LLM("unused", device="cpu", mla_prefill="latent")


def test_expanded_mode_keeps_decode_graphs_only(deepseek_checkpoints, monkeypatch):
    """Mixed graphs are off for an MLA model in expanded mode; decode steps replay the decode
    graphs (stood in for by a forward over their static buffers, as in tests/runner) and give the
    eager run's tokens."""
    pytest.importorskip("triton")
    from deepbatch.runner.cuda_graph import CudaGraphs

    path = deepseek_checkpoints["v2"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", attention_backend="triton", max_num_seqs=4,
                  max_num_batched_tokens=32)
    want = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, params, use_tqdm=False)]

    assert LLM(path, **common).engine.runner.mixed_graphs()
    llm = LLM(path, **common, mla_prefill="expanded")
    runner = llm.engine.runner
    assert runner.expanded_mla and not runner.mixed_graphs()
    graphs = CudaGraphs(runner.model, 4, runner.max_blocks_per_seq, runner.max_model_len, runner.device)
    replays = []

    def replay(size):
        replays.append(size)
        gs = graphs.decode
        return gs.model(gs.input_ids[:size], gs.positions[:size], gs.batch(size))

    graphs.decode.graphs = dict.fromkeys(graphs.decode.sizes)  # "captured"
    monkeypatch.setattr(graphs.decode, "replay", replay)
    runner.graphs = graphs
    log = PathLog(monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert replays and log.expanded
