"""Split-KV (flash-decoding) attention for decode batches: ``q_len <= 1`` for every sequence.

With few sequences and long contexts, one program per (sequence, KV head) leaves most SMs idle.
Here each sequence's keys are cut into ``num_splits`` contiguous ranges of whole ``TILE_N``
tiles; a program attends its query heads to one range and writes a normalised partial output and
its log-sum-exp; a second kernel merges the splits::

    keys:    [ split 0 | split 1 | ... | split S-1 ]      (trailing splits may be empty)
    out   =  sum_s  2^(lse_s - lse) * o_s,   lse = log2 sum_s 2^lse_s

With a sliding window ``W`` the splits cut only the window, keys ``seq_len - W .. seq_len-1``
(split 0 starts there, not tile-aligned); no key before it is read.

Semantics are those of :func:`deepbatch.kernels.paged_attention.paged_attention_ref` restricted
to decodes; the public entry is ``paged_attention(..., num_kv_splits=S)``.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.kv_quant import NO_SCALES, KVScaleArgs
from deepbatch.kernels.attend_kv_range import LOG2E, attend_kv_range
from deepbatch.kernels.common import jit as _jit
from deepbatch.kernels.common import tl, triton


@_jit(do_not_specialize=("num_splits", "stride_bt"))
def _paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr,  # [B, Hq, S, D] fp32, [B, Hq, S] fp32
    scale_log2e, out_scale, num_splits, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * QUERIES_PER_KV
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len == 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, HEAD_DIM)
    q_off = q_start.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)
    q_pos = tl.where(row_valid, seq_len - 1, -1)

    # The one query sees keys [kv_lo, seq_len): all of them, or its window's.
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(seq_len - window, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, TILE_N), num_splits)
    kv_start = kv_lo + split * tiles_per_split * TILE_N
    kv_end = tl.minimum(seq_len, kv_start + tiles_per_split * TILE_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Every key of the range is visible, so only the sequence's last partial tile needs masks.
    full_end = kv_start + tl.maximum(kv_end - kv_start, 0) // TILE_N * TILE_N
    m_i, l_i, acc = attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
        kv_start, full_end, scale_log2e, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_sb, stride_st, stride_sh, HEAD_DIM, BLOCK_SIZE, TILE_N, PRECISION, False, KV_QUANT, SLIDING,
    )
    m_i, l_i, acc = attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
        full_end, kv_end, scale_log2e, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_sb, stride_st, stride_sh, HEAD_DIM, BLOCK_SIZE, TILE_N, PRECISION, True, KV_QUANT, SLIDING,
    )
    # An empty split stores o = 0, lse = -inf: weight 0 in the merge, never NaN.
    has_keys = l_i > 0
    if KV_QUANT == 1:  # an fp8 cache's per-layer V scale
        o = acc * (out_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    else:
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, mask=row_valid[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_valid)


@_jit(do_not_specialize=("num_splits",))
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_valid, other=float("-inf"))
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_valid[:, None], other=0.0)
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len 0): the reference's output is zeros.
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    w = tl.exp2(lse - lse_max)
    denom = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
    o_off = q_start.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off + dims, res.to(out_ptr.dtype.element_ty))


def paged_decode_split_kv(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int,
    out: torch.Tensor,  # [T, Hq, D]
    kv: KVScaleArgs = NO_SCALES,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention with each sequence's keys (its last ``sliding_window`` keys, with one)
    split over ``num_splits`` programs. Inputs are those that
    :func:`deepbatch.kernels.paged_attention.paged_attention` has already checked; ``kv`` carries
    an 8-bit cache's scales as it prepared them."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    queries_per_kv = num_heads // num_kv_heads
    tile_n = 64 if head_dim <= 128 else 32
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, *kv.pointers(k_cache), block_tables, query_start_loc, seq_lens, part_out, part_lse,
        scale * kv.k_factor * LOG2E, kv.out_scale, num_splits, sliding_window or 0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *kv.strides, block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=max(16, triton.next_power_of_2(queries_per_kv)), TILE_N=tile_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", KV_QUANT=kv.mode,
        SLIDING=sliding_window is not None, num_warps=4, num_stages=2,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, query_start_loc, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out
