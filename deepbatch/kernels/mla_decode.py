"""Attention over a paged latent (MLA) cache, in the absorbed form, for a mixed batch of prefill
chunks and decodes.

Every cached token is one vector ``[c_kv (R) | k_pe (P)]``, shared by all heads (one KV head). The
query arrives already multiplied into the latent space (``q_latent = q_nope @ W_UK``), so::

    score[h, t] = (q_latent[h] . c_kv[t] + q_pe[h] . k_pe[t]) * scale
    out[h]      = softmax_t(score[h]) @ c_kv                    (still latent: [H, R])

and the caller applies ``W_UV`` and ``o_proj`` afterwards. Causal semantics are those of
:mod:`deepbatch.kernels.paged_attention`: sequence ``i`` owns query rows
``query_start_loc[i] : query_start_loc[i+1]``, the last ``q_len`` positions of its ``seq_lens[i]``
cached tokens; row ``j`` sees keys ``0 .. seq_len - q_len + j``.

With ``context_lse`` the same kernel gives the other half of the expanded MLA prefill
(:mod:`deepbatch.kernels.mla_prefill`): only sequences with ``q_len >= 2`` are computed, over
their cached context ``0 .. seq_len - q_len - 1`` alone, and each row's log-sum-exp of scaled
scores (log2 units) is written beside it; a chunk without context gets ``-inf`` there and its
rows of ``out`` are not written.

An 8-bit latent cache (``kernels/kv_quant.py``: fp8 or int8, one float32 scale per token for
``c_kv`` and one for ``k_pe``, in ``latent_scale [num_blocks, block_size, 2]``) is dequantized
where it is read: the reference dequantizes the blocks it gathers; the kernels widen each key tile
to the query's dtype in registers (exact for every int8 and fp8 value, so no fp8 ``tl.dot`` is
ever issued) and fold the scales into the score columns (``c_kv``'s and ``k_pe``'s into their own
dot) and, ``c_kv``'s, into the probabilities before the value dot. There the probabilities are
weighted by each key's absmax (its scale times the format's limit, 127 or the fp8 maximum) and
the limit is divided out of the output: the 16-bit operand then has the magnitude of the values
themselves, where ``p * scale`` would sink into fp16's subnormals (``absmax / 57344`` for e5m2).
"""

from __future__ import annotations

import torch

from deepbatch.kernels.kv_quant import check_latent_scale, dequantize_latent_ref, fp16_query, quant_limit
from deepbatch.kernels.mla_checks import check_mla_inputs
from deepbatch.kernels.paged_batch import choose_kv_splits, find_seq, gather_kv
from deepbatch.kernels.common import (jit as _jit, max_shared_memory, tl,
                                      triton)


def mla_attention_ref(
    q_latent: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    latent_cache: torch.Tensor,  # [N, bs, 1, R+P]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B+1] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_q_len: int | None = None,
    context_lse: torch.Tensor | None = None,  # [T, H] float32
    latent_scale: torch.Tensor | None = None,  # 8-bit caches: [N, bs, 2] float32
) -> torch.Tensor:
    """Plain PyTorch reference, one sequence at a time, in float32; also the CPU backend.
    ``max_q_len``, ``context_lse`` and ``latent_scale``: as in :func:`mla_attention`."""
    check_latent_scale(_ref_fail, latent_cache, latent_scale)
    if out is None:
        out = torch.empty_like(q_latent)
    rank = q_latent.shape[-1]
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = qsl[i], qsl[i + 1]
        q_len = qe - qs
        if q_len == 0 or (max_q_len is not None and q_len > max_q_len) or (context_lse is not None and q_len < 2):
            continue
        num_keys = seq_len - q_len if context_lse is not None else seq_len
        kv_scale = None if latent_scale is None else gather_kv(latent_scale, block_tables[i], num_keys)
        kv = dequantize_latent_ref(gather_kv(latent_cache, block_tables[i], num_keys)[:, 0], kv_scale, rank,
                                   torch.float32)  # [L, R+P]
        c_kv, k_pe = kv[:, :rank], kv[:, rank:]
        ql = q_latent[qs:qe].float().transpose(0, 1)  # [H, q_len, R]
        qp = q_pe[qs:qe].float().transpose(0, 1)  # [H, q_len, P]
        scores = (ql @ c_kv.T + qp @ k_pe.T) * scale  # [H, q_len, L]
        if context_lse is None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=scores.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=scores.device).unsqueeze(0)
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        else:  # every row sees the whole context
            context_lse[qs:qe] = (torch.logsumexp(scores, -1) * _LOG2E).transpose(0, 1)  # -inf: none
            if num_keys == 0:
                continue
        out[qs:qe] = (scores.softmax(-1) @ c_kv).transpose(0, 1).to(out.dtype)
    return out


def _ref_fail(msg: str) -> None:
    raise ValueError(f"mla_attention_ref: {msg}")


# A program handles BLOCK_Q query tokens of one sequence times BLOCK_H heads, packed as the rows of
# one tile (every head reads the same latent keys, so a key tile is loaded once for all rows):
#
#     row r  ->  query token  q_block * BLOCK_Q + r // BLOCK_H,   head  head_block * BLOCK_H + r % BLOCK_H
#
# and, with split-KV, one of ``num_programs(2)`` contiguous ranges of the keys it can see.


@_jit(do_not_specialize=("num_seqs", "min_q_len", "max_q_len", "stride_os", "stride_ls", "stride_bt"))
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, scale_ptr, out_ptr, lse_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, scale_log2e, num_seqs, num_heads, min_q_len, max_q_len,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    stride_cb, stride_ct, stride_sb, stride_st, stride_bt,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    WRITE_LSE: tl.constexpr, CONTEXT_ONLY: tl.constexpr, PRECISION: tl.constexpr, KV_SCALED: tl.constexpr,
    KV_LIMIT: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    # Sequences outside [min_q_len, max_q_len] belong to another launch with another tile shape.
    if (q_block * BLOCK_Q >= q_len) | (q_len < min_q_len) | (q_len > max_q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_tok = q_block * BLOCK_Q + rows // BLOCK_H
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_valid = (q_tok < q_len) & (head < num_heads)
    tok = (q_start + q_tok).to(tl.int64)
    if CONTEXT_ONLY:
        if context_len == 0:  # a fresh prompt: lse -inf says so, and its rows are not written
            tl.store(lse_ptr + tok * stride_lt + head, tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32),
                     mask=row_valid)
            return
    r_dims = tl.arange(0, BLOCK_R)
    p_dims = tl.arange(0, BLOCK_P)
    r_ok = r_dims < KV_RANK
    p_ok = p_dims < ROPE_DIM
    q_lat = tl.load(q_lat_ptr + (tok * stride_qlt + head * stride_qlh)[:, None] + r_dims[None, :],
                    mask=row_valid[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + (tok * stride_qpt + head * stride_qph)[:, None] + p_dims[None, :],
                   mask=row_valid[:, None] & p_ok[None, :], other=0.0)
    q_pos = tl.where(row_valid, context_len + q_tok, -1)
    if KV_SCALED:  # fp16 dots over an 8-bit latent (kv_quant.fp16_query says why)
        q_lat = fp16_query(q_lat)
        q_pe = fp16_query(q_pe)

    # Keys past the tile's last query are invisible to all of its rows; the rest are cut into
    # ``num_splits`` ranges of whole tiles (trailing ranges may be empty).
    if CONTEXT_ONLY:
        kv_end = context_len
    else:
        kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE_N) * TILE_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_lo, kv_hi, TILE_N):
        k_pos = start + offs_n
        k_valid = k_pos < kv_hi
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        base = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_ct  # [TILE_N]
        # The latent is both key and value: loaded once, transposed for the second dot.
        c_t = tl.load(cache_ptr + base[None, :] + r_dims[:, None], mask=k_valid[None, :] & r_ok[:, None], other=0.0)
        pe_t = tl.load(cache_ptr + base[None, :] + KV_RANK + p_dims[:, None], mask=k_valid[None, :] & p_ok[:, None],
                       other=0.0)
        if KV_SCALED:
            c_t = c_t.to(q_lat.dtype)
            pe_t = pe_t.to(q_pe.dtype)
            s_off = block * stride_sb + (k_pos % BLOCK_SIZE) * stride_st
            c_s = tl.load(scale_ptr + s_off, mask=k_valid, other=0.0)
            pe_s = tl.load(scale_ptr + s_off + 1, mask=k_valid, other=0.0)
            s = (tl.dot(q_lat, c_t, input_precision=PRECISION) * (c_s * scale_log2e)[None, :]
                 + tl.dot(q_pe, pe_t, input_precision=PRECISION) * (pe_s * scale_log2e)[None, :])
        else:
            s = tl.dot(q_lat, c_t, input_precision=PRECISION) + tl.dot(q_pe, pe_t, input_precision=PRECISION)
            s = s * scale_log2e  # [BLOCK_M, TILE_N], log2 units
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key keeps m = -inf; subtracting 0 avoids inf - inf. Visibility is
        # a prefix of the keys, so such a row sees no later tile either.
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_SCALED:
            p = p * (c_s * KV_LIMIT)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(c_t.dtype), tl.trans(c_t), input_precision=PRECISION)
        m_i = m_new

    if KV_SCALED:
        out = acc / (tl.where(l_i > 0, l_i, 1.0) * KV_LIMIT)[:, None]
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = split.to(tl.int64) * stride_os + tok * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + r_dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & r_ok[None, :])
    if WRITE_LSE:
        # Every split (or context part) writes its log-sum-exp, -inf where it saw no key: the
        # merge weighs it 0.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split.to(tl.int64) * stride_ls + tok * stride_lt + head, lse, mask=row_valid)


_LOG2E = 1.4426950408889634
_INT32_MAX = 2**31 - 1


def mla_attention(
    q_latent: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    latent_cache: torch.Tensor,  # [N, bs, 1, R+P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    num_kv_splits: int | None = None,
    max_q_len: int | None = None,
    context_lse: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`mla_attention_ref` (same semantics; module docstring).

    ``max_query_len`` and ``max_seq_len`` are the batch's maxima as host ints (no device sync); they
    pick tile shapes and the path. ``num_kv_splits``: ``None`` picks by heuristic (splits only for
    decode-only batches); ``1`` forces one pass; ``> 1`` splits the keys of every sequence and
    merges the partial results in float32 (only for ``max_query_len <= 1``). Without splits, rows
    past ``query_start_loc[-1]`` are not written; with splits their values are unspecified.
    ``max_q_len``: sequences with more query rows are skipped and their rows not written (the
    expanded MLA prefill computes them); ``max_seq_len`` may then be the maximum of the others.
    ``context_lse`` (contiguous float32 ``[T, H]``): the context-only mode of the module docstring;
    rows of sequences with ``q_len < 2`` are then not written. ``latent_scale``: an 8-bit cache's
    per-token scales (module docstring), None for a cache in the query's dtype."""
    if triton is None:
        raise RuntimeError("mla_attention: Triton is not installed; use mla_attention_ref")
    check_mla_inputs(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len,
                  out, latent_scale)
    if num_kv_splits is not None and (num_kv_splits < 1 or (num_kv_splits > 1 and max_query_len > 1)):
        raise ValueError(f"mla_attention: num_kv_splits={num_kv_splits} must be None or >= 1, and > 1 only "
                         f"with max_query_len <= 1 (got {max_query_len})")
    if max_q_len is not None and max_q_len < 1:
        raise ValueError(f"mla_attention: max_q_len must be None or >= 1, got {max_q_len}")
    if context_lse is not None and (
            context_lse.dtype != torch.float32 or context_lse.shape != q_latent.shape[:2]
            or context_lse.stride() != (q_latent.shape[1], 1) or context_lse.device != q_latent.device
            or max_q_len is not None or num_kv_splits not in (None, 1)):
        raise ValueError(f"mla_attention: context_lse must be contiguous float32 {tuple(q_latent.shape[:2])} on "
                         f"{q_latent.device}, without max_q_len or KV splits")
    if out is None:
        out = torch.empty_like(q_latent)
    num_tokens, num_heads, rank = q_latent.shape
    num_seqs = seq_lens.shape[0]
    q_len_cap = _INT32_MAX if max_q_len is None else min(max_q_len, _INT32_MAX)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # 16 heads a tile, as in sglang's MLA decode: a wider tile's [rows, R] float32 accumulator
    # outgrows the registers at R = 512.
    block_h = min(16, triton.next_power_of_2(num_heads))
    head_blocks = triton.cdiv(num_heads, block_h)
    if context_lse is not None:
        if max_query_len >= 2:
            big_m = max(16, block_h, min(32 if rank >= 256 else 64, triton.next_power_of_2(max_query_len * block_h)))
            _launch(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, scale, out, context_lse,
                    block_h, big_m, 2, _INT32_MAX, 1, context_only=True, latent_scale=latent_scale)
        return out
    if num_kv_splits is None:
        num_kv_splits = 1
        if max_query_len <= 1:
            # One program per SM is enough here: each is busy with 16 heads x 576 dims per key. At
            # 256 sequences of 640..1,920 tokens (DeepSeek-V2-Lite, bf16, H200) one pass took 259 us
            # against 304-348 us split in 2-4 (benchmarks/mla_sweep.py).
            num_kv_splits = choose_kv_splits(num_seqs, head_blocks, max_seq_len, q_latent.device, programs_per_sm=1)
    args = (q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, scale)
    if num_kv_splits == 1 and (max_query_len <= 1 or q_len_cap == 1) and q_latent.element_size() == 2:
        # One-pass decodes in 16 bits: the transposed tile makes the latent the MMA's long side
        # (172 vs 260 us in the measurement above; kernels/mla_decode_swap_ab.py).
        from deepbatch.kernels.mla_decode_swap_ab import mla_decode_swap_ab

        return mla_decode_swap_ab(*args, max_seq_len, out, latent_scale=latent_scale)

    if num_kv_splits > 1:
        partial = torch.empty(num_kv_splits, *q_latent.shape, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(num_kv_splits, num_tokens, num_heads, dtype=torch.float32, device=q_latent.device)
        _launch(*args, partial, lse, block_h, 16, 0, q_len_cap, num_kv_splits, latent_scale=latent_scale)
        # out = sum_s w_s * partial_s / sum_s w_s, with w_s = 2^(lse_s - max lse): [S, T, H]
        weights = torch.exp2(lse - lse.amax(0, keepdim=True))
        merged = (partial * weights.unsqueeze(-1)).sum(0) / weights.sum(0).unsqueeze(-1)
        return out.copy_(merged)

    # Decodes and short chunks take a 16-row tile; longer chunks, if any, a second launch with a
    # taller one (fewer rows where the float32 accumulator is wide). Skipped sequences need no
    # tile; they never take the split path above either, whose partials would span their rows.
    small_m = max(16, block_h)
    small_q = small_m // block_h
    big_m = small_m
    longest = min(max_query_len, q_len_cap)
    if longest > small_q:
        big_m = max(small_m, min(32 if rank >= 256 else 64, triton.next_power_of_2(longest * block_h)))
    if big_m == small_m:
        _launch(*args, out, None, block_h, small_m, 0, q_len_cap, 1, latent_scale=latent_scale)
    else:
        _launch(*args, out, None, block_h, small_m, 0, small_q, 1, latent_scale=latent_scale)
        _launch(*args, out, None, block_h, big_m, small_q + 1, q_len_cap, 1, latent_scale=latent_scale)
    return out


def _launch(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, scale, out, lse,
            block_h, block_m, min_q_len, max_q_len, num_splits, tile_n=None, num_warps=None, num_stages=None,
            context_only=False, latent_scale=None):
    """One launch over sequences whose q_len lies in ``[min_q_len, max_q_len]``. ``out`` is
    ``[T, H, R]``, or with ``num_splits > 1`` the float32 ``[S, T, H, R]`` partials beside ``lse``;
    ``context_only``: keys before each sequence's new tokens only, with ``lse [T, H]``.
    ``tile_n``/``num_warps``/``num_stages`` override the defaults (benchmarks/mla_sweep.py)."""
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    num_seqs = seq_lens.shape[0]
    block_q = block_m // block_h
    block_r = triton.next_power_of_2(rank)
    split = num_splits > 1
    o_strides = out.stride() if split else (0, *out.stride())
    l_strides = lse.stride()[:2] if split else (0, lse.stride(0)) if context_only else (0, 0)
    grid = (num_tokens // block_q + num_seqs, triton.cdiv(num_heads, block_h), num_splits)
    # (tile_n, warps, stages). Decode tiles of 16-bit latents at R = 512: 64 keys, 4 warps, 3 stages
    # ran best of 36 settings on an H200 (1.45 TB/s vs 1.08 with 32 keys, 8 warps, 2 stages).
    # Two buffers of 64 latent rows (R + P wide) must fit shared memory (147 KiB at R = 512).
    if (block_m <= 16 and q_latent.element_size() == 2 and block_r <= 512
            and 2 * 64 * (block_r + 64) * 2 + 8192 <= max_shared_memory(q_latent.device)):
        tiles = (64, 4, 3)
    else:
        tiles = (32 if block_r >= 256 else 64, 8 if block_r * block_m >= 8192 else 4, 2)
    scaled = latent_scale is not None
    _mla_attention_kernel[grid](
        q_latent, q_pe, latent_cache, latent_scale if scaled else latent_cache, out, lse if lse is not None else out,
        block_tables, query_start_loc, seq_lens, scale * _LOG2E, num_seqs, num_heads, min_q_len, max_q_len,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        o_strides[0], o_strides[1], o_strides[2], l_strides[0], l_strides[1],
        latent_cache.stride(0), latent_cache.stride(1), latent_scale.stride(0) if scaled else 0,
        latent_scale.stride(1) if scaled else 0, block_tables.stride(0),
        KV_RANK=rank, ROPE_DIM=rope, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_H=block_h, BLOCK_Q=block_q,
        TILE_N=tile_n or tiles[0], WRITE_LSE=split or context_only, CONTEXT_ONLY=context_only,
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", KV_SCALED=scaled,
        KV_LIMIT=quant_limit(latent_cache.dtype) if scaled else 1.0,
        num_warps=num_warps or tiles[1], num_stages=num_stages or tiles[2],
    )
