"""The expanded MLA prefill (``mla_prefill="expanded"``): prefill chunks attend over their new tokens
expanded (keys and values from one ``kv_b_proj`` GEMM) and over their cached context absorbed,
merged by log-sum-exp; decodes beside them stay absorbed. Greedy output is token-identical to HF
transformers through chunked prefill and prefix-cache hits; one layer gives the absorbed path's
output on a mixed batch; steps with chunks still go through the mixed CUDA graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import deepbatch.kernels.mla_decode as mla_decode
import deepbatch.kernels.mla_prefill as mla_prefill
import deepbatch.layers.mla as mla
from deepbatch import LLM
from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepbatch.layers.attention import make_backend
from deepbatch.layers.mla import MLARotaryEmbedding, MultiHeadLatentAttention
from deepbatch.core.forward_batch import ForwardBatch

# The tiny DeepSeek checkpoints and the HF reference helpers live beside the model tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_deepseek import (deepseek_checkpoints, hf_outputs, one_thread, prefix_hit_outputs,  # noqa: E402,F401
                           tiny_deepseek_config)
from test_hf_parity import make_prompts, ours, shared_prefix_prompts  # noqa: E402


class PathLog:
    """What each path computed: the q_lens of the requests attended expanded over their new
    tokens, of those whose whole context the absorbed attention computed, and ``(q_len,
    context_len)`` of those whose cached context alone it computed."""

    def __init__(self, monkeypatch):
        self.expanded: list[int] = []
        self.absorbed: list[int] = []
        self.context: list[tuple[int, int]] = []

        def lens(query_start_loc, seq_lens):
            qsl = query_start_loc.tolist()
            return list(zip([b - a for a, b in zip(qsl, qsl[1:])], seq_lens.tolist()))

        def expanded(fn):
            def log(q_nope, q_pe, k_nope, k_pe, v, query_start_loc, *args, **kwargs):
                qsl = query_start_loc.tolist()
                self.expanded += [b - a for a, b in zip(qsl, qsl[1:]) if b - a >= 2]
                return fn(q_nope, q_pe, k_nope, k_pe, v, query_start_loc, *args, **kwargs)
            return log

        def absorbed(fn):
            def log(q_latent, q_pe, cache, tables, query_start_loc, seq_lens, *args, max_q_len=None,
                    context_lse=None, **kwargs):
                for q, s in lens(query_start_loc, seq_lens):
                    if context_lse is not None and q >= 2:
                        self.context.append((q, s - q))
                    elif context_lse is None and 0 < q <= (max_q_len or q):
                        self.absorbed.append(q)
                return fn(q_latent, q_pe, cache, tables, query_start_loc, seq_lens, *args, max_q_len=max_q_len,
                          context_lse=context_lse, **kwargs)
            return log

        monkeypatch.setattr(mla, "mla_prefill_ref", expanded(mla.mla_prefill_ref))
        monkeypatch.setattr(mla_prefill, "mla_prefill", expanded(mla_prefill.mla_prefill))
        monkeypatch.setattr(mla, "mla_attention_ref", absorbed(mla.mla_attention_ref))
        monkeypatch.setattr(mla_decode, "mla_attention", absorbed(mla_decode.mla_attention))

    def assert_split(self):
        """Chunks, some over cached context, went expanded with their context absorbed; the
        absorbed attention over whole contexts saw decodes only."""
        assert self.expanded and sorted(self.expanded) == sorted(q for q, _ in self.context)
        assert any(ctx > 0 for _, ctx in self.context)
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
def test_absorbed_mode_matches_hf(deepseek_checkpoints, arch, monkeypatch):
    """``mla_prefill="absorbed"``: chunks, prefix hits included, stay in the latent space."""
    path = deepseek_checkpoints[arch]
    prompts = make_prompts()
    log = PathLog(monkeypatch)
    got, _ = ours(path, prompts, max_num_batched_tokens=16, mla_prefill="absorbed")
    assert got == hf_outputs(path, prompts)
    hits, _ = prefix_hit_outputs(path, mla_prefill="absorbed")
    assert hits == hf_outputs(path, shared_prefix_prompts())
    assert log.expanded == [] and log.context == [] and max(log.absorbed) > 1


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_prefix_cache_hits_match_hf(deepseek_checkpoints, arch, monkeypatch):
    path = deepseek_checkpoints[arch]
    log = PathLog(monkeypatch)
    got, rest = prefix_hit_outputs(path, mla_prefill="expanded")
    assert got == hf_outputs(path, shared_prefix_prompts())
    assert all(o.num_cached_tokens > 0 for o in rest)
    # Every hit's chunk attends over the cached prefix (the one-token one is absorbed).
    hits = sum(1 for _, ctx in log.context if ctx >= 48)
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
# that starts and ends mid-block. Two orders: decodes first, and chunks between decodes.
ORDERS = {
    "decodes-first": [(1, 13), (1, 1), (1, 30), (3, 3), (5, 18), (2, 2), (6, 6), (9, 9)],
    "chunks-among-decodes": [(3, 3), (1, 13), (5, 18), (2, 2), (1, 1), (6, 6), (1, 30), (9, 9)],
}


def _layer(arch: str):
    config = tiny_deepseek_config(arch)
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(config, prefill_mode="absorbed")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.fill_(1.0) if "layernorm" in name else p.normal_(0.0, 0.15)
    rope = MLARotaryEmbedding(config, config.qk_rope_head_dim, config.max_position_embeddings, arch == "v2")
    return config, layer, rope


def _mixed_batch(lens, num_blocks: int, num_pad_tokens: int = 0, num_pad_seqs: int = 0) -> ForwardBatch:
    """Shuffled, non-contiguous blocks; the new tokens' slots are the last q_len of each request.
    Padding as a mixed CUDA graph has it: tokens of no sequence, sequences of q_len 0."""
    width = max(-(-s // BLOCK_SIZE) for _, s in lens)
    ids = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width)
    positions, slots, qsl = [], [], [0]
    for i, (q, s) in enumerate(lens):
        pos = torch.arange(s - q, s)
        positions.append(pos)
        slots.append(ids[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + q)
    positions.append(torch.zeros(num_pad_tokens, dtype=torch.long))
    slots.append(torch.full((num_pad_tokens,), -1))
    qsl += [qsl[-1]] * num_pad_seqs
    q_lens, seq_lens = [q for q, _ in lens], [s for _, s in lens]
    tables = torch.cat((ids, torch.zeros(num_pad_seqs, width, dtype=ids.dtype)))
    return ForwardBatch(
        input_ids=torch.zeros(qsl[-1] + num_pad_tokens, dtype=torch.long),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens + [0] * num_pad_seqs, dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        logits_indices=torch.tensor([qsl[-1] - 1]),
        max_query_len=max(q_lens) + num_pad_tokens,
        max_seq_len=max(seq_lens),
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
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    chunks = [(q, s - q) for q, s in lens if q > 1]
    assert sorted(log.expanded) == sorted(q for q, _ in chunks)
    assert sorted(log.context) == sorted(chunks)
    assert log.absorbed == [1] * sum(q == 1 for q, _ in lens)
    assert gemms == [batch.num_tokens]  # one decompression of the step's own tokens


def test_expanded_step_with_graph_padding_matches_absorbed():
    """A mixed graph's batch: padding tokens of no sequence and empty sequence slots, through the
    Triton kernels; the real rows match the absorbed path."""
    pytest.importorskip("triton")
    config, layer, rope = _layer("v3")
    cache = torch.randn(64, BLOCK_SIZE, 1, config.kv_lora_rank + config.qk_rope_head_dim)
    layer.bind([cache], make_backend("triton"))
    lens = ORDERS["chunks-among-decodes"]
    batch = _mixed_batch(lens, 64, num_pad_tokens=5, num_pad_seqs=3)
    x = torch.randn(batch.num_tokens, config.hidden_size)
    at = rope.at(batch.positions)
    real = sum(q for q, _ in lens)
    with torch.no_grad():
        want = layer(x, at, batch)[:real]
        layer.prefill_mode = "expanded"
        got = layer(x, at, batch)[:real]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_expanded_decode_only_step_stays_absorbed(monkeypatch):
    config, layer, rope = _layer("v3")
    cache = torch.randn(64, BLOCK_SIZE, 1, config.kv_lora_rank + config.qk_rope_head_dim)
    layer.bind([cache], make_backend("torch"))
    layer.prefill_mode = "expanded"
    batch = _mixed_batch([(1, 13), (1, 30)], 64)
    log = PathLog(monkeypatch)
    with torch.no_grad():
        layer(torch.randn(2, config.hidden_size), rope.at(batch.positions), batch)
    assert log.expanded == [] and log.context == [] and log.absorbed == [1, 1]


# -- configuration and CUDA graphs -------------------------------------------------------------


def test_bad_mla_prefill_raises():
    with pytest.raises(ValueError, match="mla_prefill"):
        ModelConfig(None, torch.float32, None, mla_prefill="decompressed")
    with pytest.raises(ValueError, match="prefill_mode"):
        MultiHeadLatentAttention(tiny_deepseek_config("v2"), prefill_mode="latent")
    with pytest.raises(ValueError, match="mla_prefill"):
        LLM("unused", device="cpu", mla_prefill="latent")


def test_expanded_mode_keeps_mixed_graphs(deepseek_checkpoints):
    """Nothing in the expanded path reads lengths on the host: the runner captures steps with
    chunks in either mode."""
    pytest.importorskip("triton")
    path = deepseek_checkpoints["v2"]
    common = dict(dtype="float32", device="cpu", attention_backend="triton", max_num_seqs=4,
                  max_num_batched_tokens=32)
    for mode in ("absorbed", "expanded"):
        runner = LLM(path, **common, mla_prefill=mode).engine.runner
        assert runner.mixed_graphs()
        assert {a.prefill_mode for a in runner.attn_layers} == {mode}
