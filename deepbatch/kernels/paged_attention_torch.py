"""The CPU backend of paged attention: ``paged_attention_ref``'s contract (``kernels/paged_attention.py``)
with batched decodes. Prefill chunks are attended one sequence at a time; decodes gather all
their keys in one go (a window: only the window's), so a CPU step costs a few large ops, not one
small op per sequence. Also what the Triton kernels are held to where a test runs both."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepbatch.kernels.kv_quant import dequantize_ref
from deepbatch.kernels.paged_attention import check_sliding_window, first_key, gather_dequant, reference_kv_scales


def _fail(msg):
    raise ValueError(f"paged_attention: {msg}")


def paged_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The CPU backend: the reference's semantics through SDPA. Decode rows (``q_len == 1``) of
    the whole batch go through one padded SDPA call; prefill chunks go one sequence at a time.
    An 8-bit cache is dequantized to the query's dtype as its blocks are gathered. With a
    window, only the keys inside it are gathered."""
    check_sliding_window(_fail, sliding_window)
    k_scale, v_scale = reference_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    if max_query_len == 1 or (max_query_len is None and query.shape[0] == num_seqs):
        if sliding_window is not None:
            return _decode_batched_window(query, k_cache, v_cache, block_tables, seq_lens, scale, out, k_scale,
                                          v_scale, sliding_window)
        return _decode_batched(query, k_cache, v_cache, block_tables, seq_lens, scale, out, k_scale, v_scale)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        qs, qe = qsl[i], qsl[i + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        lo = first_key(seq_len, q_len, sliding_window)
        q = query[qs:qe].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        k = gather_dequant(k_cache, k_scale, block_tables[i], seq_len, query.dtype, lo).transpose(0, 1).unsqueeze(0)
        v = gather_dequant(v_cache, v_scale, block_tables[i], seq_len, query.dtype, lo).transpose(0, 1).unsqueeze(0)
        if q_len == seq_len and sliding_window is None:
            mask, causal = None, q_len > 1
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(lo, seq_len, device=query.device).unsqueeze(0)
            mask, causal = k_pos <= q_pos, False
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def _decode_batched(query, k_cache, v_cache, block_tables, seq_lens, scale, out, k_scale, v_scale):
    bs = k_cache.shape[1]
    max_len = int(seq_lens.max())
    nb = -(-max_len // bs)
    tables = block_tables[:, :nb].long()

    def gather(cache, kv_scale):  # [B, Hkv, L, D] in the query's dtype
        if torch.is_tensor(kv_scale):
            kv_scale = kv_scale[tables].flatten(1, 2)[:, :max_len]
        return dequantize_ref(cache[tables].flatten(1, 2)[:, :max_len], kv_scale, query.dtype).transpose(1, 2)

    k = gather(k_cache, k_scale)
    v = gather(v_cache, v_scale)
    mask = torch.arange(max_len, device=query.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    out.copy_(o.squeeze(2))
    return out


def _decode_batched_window(query, k_cache, v_cache, block_tables, seq_lens, scale, out, k_scale, v_scale, window):
    """:func:`_decode_batched` over each sequence's last ``window`` keys only, gathered by token
    (``[B, min(max_len, window)]``), so no block that slid out of a window is indexed."""
    bs = k_cache.shape[1]
    width = min(int(seq_lens.max()), window)
    lens = seq_lens.long()
    lo = (lens - window).clamp(min=0)  # [B]
    offs = torch.arange(width, device=query.device)
    valid = offs.unsqueeze(0) < (lens - lo).unsqueeze(1)  # [B, L]
    # Rows past a sequence's end re-read its last key (masked): every index stays in its table.
    pos = torch.minimum(lo.unsqueeze(1) + offs, (lens - 1).clamp(min=0).unsqueeze(1))
    blocks = block_tables.gather(1, pos // bs).long()
    slots = pos % bs

    def gather(cache, kv_scale):  # [B, Hkv, L, D] in the query's dtype
        if torch.is_tensor(kv_scale):
            kv_scale = kv_scale[blocks, slots]
        return dequantize_ref(cache[blocks, slots], kv_scale, query.dtype).transpose(1, 2)

    k = gather(k_cache, k_scale)
    v = gather(v_cache, v_scale)
    o = F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    out.copy_(o.squeeze(2))
    return out
