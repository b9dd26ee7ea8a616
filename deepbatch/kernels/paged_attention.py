"""Attention over the paged KV cache for a mixed batch of prefill chunks and decodes.

Sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` (``q_len`` rows) and
has ``seq_len = seq_lens[i]`` tokens in the cache, the new ones included. Its query rows are the
last ``q_len`` positions of the sequence::

    keys:     0 ............................. seq_len-1
    queries:                      [seq_len-q_len ... seq_len-1]
    row j attends to keys 0 .. seq_len - q_len + j   (causal inside the chunk, full over context)

A decode is ``q_len == 1``; a chunked prefill or a prefix-cache hit is ``q_len < seq_len``.

With a sliding window ``W`` (Mistral, Qwen2's windowed layers) a query at position ``p`` sees
only keys ``p - W < key <= p`` (transformers' ``sliding_window`` semantics: ``W`` keys, itself
included). No key before ``first_query - W + 1`` is ever read, so the block-table entries of
blocks that slid out of the window may name blocks that belong to someone else now, or none
(``kv_cache/manager.py`` writes ``-1`` there)::

    keys:      0 ...... lo ...................... seq_len-1       lo = seq_len - q_len - W + 1
    read:               [lo ......................... ]
    row j:              [p_j - W + 1 ... p_j]                     p_j = seq_len - q_len + j

An 8-bit cache (``kernels/kv_quant.py``) is dequantized where it is read: the references
dequantize the blocks they gather for one batch; the kernels convert each K/V tile in registers
and fold the scales into the scores (per-layer fp8 K scale: the softmax scale; per-token int8
K scales: the score columns) and into the probabilities (per-token int8 V scales) or the output
(per-layer fp8 V scale), so no tile is ever rescaled element by element.
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import check_like, check_paged_metadata, jit as _jit, max_shared_memory, tl, triton
from deepbatch.kernels.attend_kv_range import LOG2E, attend_kv_range
from deepbatch.kernels.paged_batch import choose_kv_splits, find_seq, gather_kv
from deepbatch.kernels.kv_quant import NO_SCALES, KVScaleArgs, check_kv_scales, dequantize_ref, quant_mode


def gather_dequant(cache: torch.Tensor, kv_scale, block_table: torch.Tensor, seq_len: int,
                   dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """:func:`gather_kv` dequantized to ``dtype``; ``kv_scale``: None, a float (fp8) or the int8
    per-token scales ``[N, bs, Hkv]``."""
    if torch.is_tensor(kv_scale):
        kv_scale = gather_kv(kv_scale, block_table, seq_len, start)
    return dequantize_ref(gather_kv(cache, block_table, seq_len, start), kv_scale, dtype)


def first_key(seq_len: int, q_len: int, sliding_window: int | None) -> int:
    """The first key any of a sequence's query rows sees (0 without a window)."""
    return 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)


def check_sliding_window(fail, sliding_window) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        fail(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def _fail(msg):
    raise ValueError(f"paged_attention: {msg}")


def reference_kv_scales(k_cache, v_cache, k_scale, v_scale):
    """The scales the torch references pass to :func:`dequantize_ref` (checked like the kernels')."""
    mode, k_float, v_float = check_kv_scales(_fail, k_cache, v_cache, k_scale, v_scale)
    return (None, None) if mode == 0 else (k_float, v_float) if mode == 1 else (k_scale, v_scale)


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B+1] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,  # fp8: float; int8: [N, bs, Hkv] float32
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference, one sequence at a time, in float32."""
    check_sliding_window(_fail, sliding_window)
    k_scale, v_scale = reference_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        qs, qe = qsl[i], qsl[i + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        lo = first_key(seq_len, q_len, sliding_window)
        q = query[qs:qe].float().transpose(0, 1)  # [Hq, q_len, D]
        k = gather_dequant(k_cache, k_scale, block_tables[i], seq_len, torch.float32, lo).transpose(0, 1)  # [Hkv, L, D]
        v = gather_dequant(v_cache, v_scale, block_tables[i], seq_len, torch.float32, lo).transpose(0, 1)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(lo, seq_len, device=query.device).unsqueeze(0)
        scores = (q @ k.transpose(1, 2)) * scale  # [Hq, q_len, L]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[qs:qe] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
    return out


# Every program of the kernels below handles one KV head and the ``G = Hq // Hkv`` query heads that
# share it, packed as rows of one tile so that each K/V tile is loaded once for the whole group:
#
#     row r  ->  query token  q_block * BLOCK_Q + r // G,   query head  kv_head * G + r % G
#
# Rows past ``BLOCK_Q * G`` or past the chunk's end are masked.
@_jit(do_not_specialize=("num_seqs", "min_q_len", "max_q_len", "stride_bt"))
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, scale_log2e, out_scale, num_seqs, min_q_len, max_q_len, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_sb, stride_st, stride_sh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr, SLIDING: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    # Sequences outside [min_q_len, max_q_len] belong to another launch with another tile shape.
    if (q_block * BLOCK_Q >= q_len) | (q_len < min_q_len) | (q_len > max_q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    dims = tl.arange(0, HEAD_DIM)
    q_off = (q_start + q_tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)
    q_pos = tl.where(row_valid, context_len + q_tok, -1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The tile's rows are queries q_first .. kv_end-1. With a window W:
    #
    #   [kv_lo, full_start)     keys the first rows see and the last ones no longer do: masked
    #   [full_start, full_end)  whole tiles every row sees: no masks
    #   [full_end, kv_end)      the causal diagonal and the ragged end: masked
    #
    #   kv_lo = q_first - W + 1 (the first row's oldest key), full_start = kv_end - W (the last
    #   row's); without a window both are 0. Keys before kv_lo are never read, and keys past the
    #   tile's last query are invisible to all of its rows.
    q_first = context_len + q_block * BLOCK_Q
    kv_end = tl.minimum(seq_len, q_first + BLOCK_Q)
    kv_lo = 0
    full_start = 0
    if SLIDING:
        kv_lo = tl.maximum(q_first - window + 1, 0)
        full_start = tl.maximum(kv_end - window, kv_lo)
    full_end = full_start + tl.maximum(q_first + 1 - full_start, 0) // TILE_N * TILE_N
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if SLIDING:
        m_i, l_i, acc = attend_kv_range(
            q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
            kv_lo, full_start, scale_log2e, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_sb, stride_st, stride_sh, HEAD_DIM, BLOCK_SIZE, TILE_N, PRECISION, True, KV_QUANT, SLIDING,
        )
    m_i, l_i, acc = attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
        full_start, full_end, scale_log2e, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_sb, stride_st, stride_sh, HEAD_DIM, BLOCK_SIZE, TILE_N, PRECISION, False, KV_QUANT, SLIDING,
    )
    m_i, l_i, acc = attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head,
        full_end, kv_end, scale_log2e, window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_sb, stride_st, stride_sh, HEAD_DIM, BLOCK_SIZE, TILE_N, PRECISION, True, KV_QUANT, SLIDING,
    )
    # l_i == 0 only for a sequence with no keys (seq_len 0): the reference gives zeros there.
    if KV_QUANT == 1:  # an fp8 cache's per-layer V scale
        out = acc * (out_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + q_tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len, out,
                  k_scale=None, v_scale=None) -> tuple[int, float, float]:
    """``(quant mode, K float scale, V float scale)`` of valid inputs (``kv_quant.check_kv_scales``)."""
    def fail(msg):
        raise ValueError(f"paged_attention: {msg}")

    if query.dim() != 3:
        fail(f"query must be [T, Hq, D], got shape {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        fail(f"k_cache and v_cache must be [num_blocks, block_size, Hkv, D] of one shape, got "
             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        fail(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        fail(f"query heads {num_heads} must be a multiple of KV heads {num_kv_heads}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        fail(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if query.dtype not in _DTYPES:
        fail(f"query dtype {query.dtype} is not one of {_DTYPES}")
    quantized = quant_mode(k_cache.dtype) != 0
    # An 8-bit cache is read with the query's dtype; any other cache must have it.
    check_like(fail, "query", query, (("out", out),) if quantized else (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)))
    if quantized:
        check_like(fail, "k_cache", k_cache, (("v_cache", v_cache),))
        if k_cache.device != query.device:
            fail(f"k_cache is on {k_cache.device}, query on {query.device}")
    if out is not None and out.shape != query.shape:
        fail(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    check_paged_metadata(fail, query.device, query.shape[0], k_cache.shape[1], block_tables, query_start_loc, seq_lens,
                         max_query_len, max_seq_len)
    return check_kv_scales(fail, k_cache, v_cache, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    num_kv_splits: int | None = None,
    k_scale: float | torch.Tensor | None = None,  # fp8: float; int8: [N, bs, Hkv] float32
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_ref` (same semantics; module docstring).

    ``max_query_len`` and ``max_seq_len`` are the batch's maxima as host ints (no device sync);
    they pick tile shapes and the path, never correctness, except that ``max_query_len == 1``
    with a split promises every sequence has ``q_len <= 1``. ``num_kv_splits``: ``None`` picks
    by heuristic; ``1`` forces the one-pass kernel; ``> 1`` forces the split-KV decode path (only
    for ``max_query_len <= 1``). Rows past ``query_start_loc[-1]`` (CUDA-graph padding) are not
    written. head_dim must be a power of two in [16, 256]; any block_size works. An fp8 or int8
    cache takes its scales in ``k_scale``/``v_scale`` (``kernels/kv_quant.py``). A layer's
    ``sliding_window`` is a constant of its kernel launches: it never changes a grid or a shape,
    so steps keep their CUDA graphs."""
    if triton is None:
        raise RuntimeError("paged_attention: Triton is not installed; use paged_attention_torch")
    check_sliding_window(_fail, sliding_window)
    kv = KVScaleArgs(_check_inputs(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len,
                                 max_seq_len, out, k_scale, v_scale), k_scale, v_scale)
    if num_kv_splits is not None and (num_kv_splits < 1 or (num_kv_splits > 1 and max_query_len > 1)):
        raise ValueError(f"paged_attention: num_kv_splits={num_kv_splits} must be None or >= 1, and > 1 only "
                         f"with max_query_len <= 1 (got {max_query_len})")
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads

    if num_kv_splits is None:
        num_kv_splits = 1
        if max_query_len <= 1:
            # A decode reads at most a window of keys, however long its sequence.
            num_keys = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
            num_kv_splits = choose_kv_splits(num_seqs, num_kv_heads, num_keys, query.device)
    if num_kv_splits > 1:
        from deepbatch.kernels.paged_decode_split_kv import paged_decode_split_kv

        return paged_decode_split_kv(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, num_kv_splits, out, kv,
            sliding_window=sliding_window,
        )

    # Decodes and short chunks take a small tile; longer chunks, if any, a second launch with a
    # tall one. Both shapes come from bucketed values: a serving loop compiles a handful of variants.
    small_m = max(16, triton.next_power_of_2(queries_per_kv))
    small_q = small_m // queries_per_kv
    big_m = small_m
    if max_query_len > small_q:
        # 64 rows beat 128 on an H200 for d=128 prefill (473 vs 566 us for 4 x 2048 tokens).
        big_m = max(small_m, min(64, triton.next_power_of_2(max_query_len * queries_per_kv)))
    args = (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out)
    if big_m == small_m:
        _launch(*args, block_m=small_m, min_q_len=0, max_q_len=_INT32_MAX, kv=kv, sliding_window=sliding_window)
    else:
        _launch(*args, block_m=small_m, min_q_len=0, max_q_len=small_q, kv=kv, sliding_window=sliding_window)
        _launch(*args, block_m=big_m, min_q_len=small_q + 1, max_q_len=_INT32_MAX, kv=kv,
                sliding_window=sliding_window)
    return out


_INT32_MAX = 2**31 - 1


def _launch(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
            block_m, min_q_len, max_q_len, tile_n=None, num_warps=None, num_stages=None, kv: KVScaleArgs = NO_SCALES,
            sliding_window: int | None = None):
    """One launch of the kernel over sequences whose q_len lies in ``[min_q_len, max_q_len]``."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    queries_per_kv = num_heads // num_kv_heads
    block_q = block_m // queries_per_kv
    # Decode-sized tiles of 16-bit KV stream best with long key tiles and a deep pipeline: 4.00 vs
    # 3.69 TB/s for 256 sequences of 100..1,600 tokens, 16/8 heads, d=128 on an H200
    # (benchmarks/attention_sweep.py --ragged). fp32 tiles that long would not fit shared memory.
    # Their K and V buffers (num_stages - 1 of each, as the pipeliner allocates) need 192 KiB at
    # d=128: GPUs with less shared memory keep the smaller defaults.
    decode_tiles = (block_m <= 16 and head_dim <= 128 and query.element_size() == 2
                    and 3 * 2 * 128 * head_dim * 2 + 8192 <= max_shared_memory(query.device))
    if tile_n is None:
        tile_n = 128 if decode_tiles else 64 if head_dim <= 128 else 32
    if num_warps is None:
        num_warps = 8 if block_m >= 128 or head_dim > 128 else 4
    if num_stages is None:
        num_stages = 4 if decode_tiles else 2
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, *kv.pointers(k_cache), out, block_tables, query_start_loc, seq_lens,
        scale * kv.k_factor * LOG2E, kv.out_scale, num_seqs, min_q_len, max_q_len, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *kv.strides, block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", KV_QUANT=kv.mode,
        SLIDING=sliding_window is not None, num_warps=num_warps, num_stages=num_stages,
    )
