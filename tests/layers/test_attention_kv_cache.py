"""The paged attention layer over an 8-bit cache: what it asks the runner to allocate, that an fp8
cache uses the layer's checkpoint scales on both the write and the read, and that a prefill
through the layer equals causal attention over K/V put through the format's round trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepbatch.layers.attention import AttentionBackend, PagedAttention
from deepbatch.core.forward_batch import ForwardBatch

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 4


def test_cache_specs_per_dtype():
    layer = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    assert layer.cache_specs(torch.bfloat16) == [((KV_HEADS, DIM), torch.bfloat16)] * 2
    assert layer.cache_specs(torch.float8_e4m3fn) == [((KV_HEADS, DIM), torch.float8_e4m3fn)] * 2
    assert layer.cache_specs(torch.int8) == [((KV_HEADS, DIM), torch.int8)] * 2 + [((KV_HEADS,), torch.float32)] * 2


def test_checkpoint_scales():
    layer = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    assert (layer.k_scale, layer.v_scale, layer.kv_scale_source) == (1.0, 1.0, None)
    layer.load_kv_scale("model.layers.3.self_attn.k_scale", torch.tensor(0.25))
    layer.load_kv_scale("model.layers.3.self_attn.v_scale", torch.tensor([0.1, 0.5]))  # per head: the largest
    assert (layer.k_scale, layer.v_scale, layer.kv_scale_source) == (0.25, 0.5, "checkpoint")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and > 0"):
            layer.load_kv_scale("k_scale", torch.tensor(bad))
    with pytest.raises(ValueError, match="not a k_scale"):
        layer.load_kv_scale("q_scale", torch.tensor(1.0))


def _round_trip(x, cache_dtype, scale):
    if cache_dtype == torch.int8:
        s = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / s) * s
    limit = torch.finfo(cache_dtype).max
    return (x / scale).clamp(-limit, limit).to(cache_dtype).float() * scale


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_prefill_attends_over_the_round_trip(cache_dtype):
    g = torch.Generator().manual_seed(0)
    T, num_blocks = 10, 8
    layer = PagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    if cache_dtype != torch.int8:
        layer.load_kv_scale("k_scale", torch.tensor(0.5))
        layer.load_kv_scale("v_scale", torch.tensor(0.125))
    caches = [torch.zeros(num_blocks, BLOCK, *shape, dtype=dtype) for shape, dtype in layer.cache_specs(cache_dtype)]
    layer.bind(caches, AttentionBackend())
    q = torch.randn(T, HEADS, DIM, generator=g)
    k = torch.randn(T, KV_HEADS, DIM, generator=g) * 40  # past e4m3's 448 at the V scale: saturates
    v = torch.randn(T, KV_HEADS, DIM, generator=g) * 40
    blocks = torch.tensor([5, 2, 7], dtype=torch.int32)
    pos = torch.arange(T)
    batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long), positions=pos,
                         slot_mapping=(blocks.long()[pos // BLOCK] * BLOCK + pos % BLOCK),
                         query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                         seq_lens=torch.tensor([T], dtype=torch.int32), block_tables=blocks.unsqueeze(0),
                         logits_indices=torch.tensor([T - 1]), max_query_len=T, max_seq_len=T)
    out = layer(q, k, v, batch)
    assert caches[0].dtype == cache_dtype
    k_rt = _round_trip(k, cache_dtype, 0.5).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    v_rt = _round_trip(v, cache_dtype, 0.125).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k_rt, v_rt, is_causal=True, scale=DIM**-0.5)
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-3, rtol=1e-4)  # values ~40
    if cache_dtype == torch.float8_e4m3fn:
        assert (v_rt.abs().amax() - 448 * 0.125).abs() < 1e-6  # V saturated where x / scale passed 448
