"""Absorbed MLA decode with the products transposed ("swap AB"), for batches where every sequence
has at most one query row. Same semantics as :func:`deepbatch.kernels.mla_decode.mla_attention_ref`.

The decode tile of :mod:`deepbatch.kernels.mla_decode` has 16 rows, one per head: its dots are
``[16, R] @ [R, N]`` and ``[16, N] @ [N, R]``. Hopper's warpgroup MMA needs M to be a multiple of
64, so at M = 16 Triton falls back to the older register-operand MMA. Here the long dimensions
are M instead::

    s^T   [N, H] = c_tile [N, R] @ q_lat^T [R, H]  +  pe_tile [N, P] @ q_pe^T [P, H]
    acc^T [R, H] += c_tile^T [R, N] @ p^T [N, H]

with softmax statistics per column (head). Each key tile is loaded once, token-major, and feeds
both dots (the second through ``tl.trans``), so both may read one shared-memory buffer. An 8-bit
latent cache is widened to the query's dtype as the tile is loaded, and its per-token scales
(rows of ``s^T``) go into the scores and, ``c_kv``'s times the format's limit, into ``p^T`` (as
in ``mla_decode``).
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import jit as _jit, max_shared_memory, tl, triton
from deepbatch.kernels.kv_quant import fp16_query, quant_limit
from deepbatch.kernels.mla_checks import check_mla_inputs

# Heads per program: the N of both dots. The float32 accumulator is [R, BLOCK_H]; at R = 512 and
# 4 warps, 16 heads already take 64 registers a thread.
_BLOCK_H = 16
_LOG2E = 1.4426950408889634


# One program per (sequence, 16 heads). q_latent's head stride is T * R for the head-major bmm
# output, so it changes every step, as does the block-table width.
@_jit(do_not_specialize=("stride_qlh", "stride_bt"))
def _mla_decode_swap_ab_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, scale_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2e, num_heads,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_cb, stride_ct, stride_sb, stride_st,
    stride_bt,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr, KV_LIMIT: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    # Sequences with no query row write nothing; longer chunks belong to another kernel.
    if tl.load(query_start_loc_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    r_dims = tl.arange(0, BLOCK_R)
    p_dims = tl.arange(0, BLOCK_P)
    r_ok = r_dims < KV_RANK
    p_ok = p_dims < ROPE_DIM
    tok = q_start.to(tl.int64)
    # The query, transposed: [dims, heads]. Masked heads and dims read 0, so their scores are 0
    # (finite) and add nothing to the real heads' dots.
    q_lat_t = tl.load(q_lat_ptr + tok * stride_qlt + heads[None, :] * stride_qlh + r_dims[:, None],
                      mask=r_ok[:, None] & h_ok[None, :], other=0.0)
    q_pe_t = tl.load(q_pe_ptr + tok * stride_qpt + heads[None, :] * stride_qph + p_dims[:, None],
                     mask=p_ok[:, None] & h_ok[None, :], other=0.0)
    if KV_SCALED:  # fp16 dots over an 8-bit latent (kv_quant.fp16_query says why)
        q_lat_t = fp16_query(q_lat_t)
        q_pe_t = fp16_query(q_pe_t)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    # Block ids run one tile ahead in registers. Left in the loop, their load is the first link of
    # an indirect chain and takes a pipeline stage: the key tile is then prefetched only one
    # iteration ahead, issued after this tile's dots, and never overlaps them.
    block_next = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0)
    # The one query row is the last position: it sees every cached key, so only the tail of the
    # last tile is masked, and every tile holds a valid key (m stays finite after the first).
    for start in range(0, seq_len, TILE_N):
        k_pos = start + offs_n
        k_valid = k_pos < seq_len
        block = block_next.to(tl.int64)
        next_pos = k_pos + TILE_N
        block_next = tl.load(block_table_ptr + next_pos // BLOCK_SIZE, mask=next_pos < seq_len, other=0)
        base = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_ct  # [TILE_N]
        # Token-major: each key's R latent values are contiguous, the rows of the dots' M side.
        c = tl.load(cache_ptr + base[:, None] + r_dims[None, :], mask=k_valid[:, None] & r_ok[None, :], other=0.0)
        pe = tl.load(cache_ptr + base[:, None] + KV_RANK + p_dims[None, :], mask=k_valid[:, None] & p_ok[None, :],
                     other=0.0)
        if KV_SCALED:
            c = c.to(q_lat_t.dtype)
            pe = pe.to(q_pe_t.dtype)
            s_off = block * stride_sb + (k_pos % BLOCK_SIZE) * stride_st
            c_s = tl.load(scale_ptr + s_off, mask=k_valid, other=0.0)
            pe_s = tl.load(scale_ptr + s_off + 1, mask=k_valid, other=0.0)
            s = (tl.dot(c, q_lat_t, input_precision=PRECISION) * (c_s * scale_log2e)[:, None]
                 + tl.dot(pe, q_pe_t, input_precision=PRECISION) * (pe_s * scale_log2e)[:, None])
        else:
            s = tl.dot(c, q_lat_t, input_precision=PRECISION) + tl.dot(pe, q_pe_t, input_precision=PRECISION)
            s = s * scale_log2e
        s = tl.where(k_valid[:, None], s, float("-inf"))  # [TILE_N, BLOCK_H], log2 units
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, 0)
        if KV_SCALED:
            p = p * (c_s * KV_LIMIT)[:, None]
        acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p.to(c.dtype), input_precision=PRECISION)
        m_i = m_new

    # seq_len 0: no tile ran, acc and l are 0 and the row is zeros.
    if KV_SCALED:
        out = acc / (tl.where(l_i > 0, l_i, 1.0) * KV_LIMIT)[None, :]
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
    # Stored through transposed pointers: out[token, head, r] with r along the accumulator's rows.
    o_ptrs = out_ptr + tok * stride_ot + heads[None, :] * stride_oh + r_dims[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & h_ok[None, :])


def _default_tiles(block_r, block_p, element_size, device):
    """(tile_n, num_warps, num_stages). At DeepSeek-V2-Lite's shapes on an H200 (bf16, 256
    sequences of 640..1,920 tokens, benchmarks/mla_sweep.py) 32 keys, 4 warps and 3 stages ran
    best: 172 us (2.18 TB/s of latents) against 260 us for mla_decode's 16-row tile; 64 keys
    with 8 warps and 2 stages took 265 us. At 32 keys the output dot (M = R) is a warpgroup MMA
    and the score dot a register MMA; two key tiles in flight take 91 KiB of shared memory, so
    two programs share an SM. Smaller tiles where that does not fit."""
    def fits(tile_n, stages):
        tiles = (stages - 1) * tile_n * (block_r + block_p) * element_size
        return tiles + (block_r + block_p + tile_n) * _BLOCK_H * element_size <= max_shared_memory(device)

    if fits(32, 3):
        return 32, 4, 3
    return 16, 4, 2


def mla_decode_swap_ab(
    q_latent: torch.Tensor,  # [T, H, R]
    q_pe: torch.Tensor,  # [T, H, P]
    latent_cache: torch.Tensor,  # [N, bs, 1, R+P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    latent_scale: torch.Tensor | None = None,  # 8-bit caches: [N, bs, 2] float32
) -> torch.Tensor:
    """:func:`~deepbatch.kernels.mla_decode.mla_attention` for decode batches (module docstring).

    Sequences with exactly one query row are computed; those with none, or more (a prefill chunk,
    left to another kernel), write nothing, and neither do rows past ``query_start_loc[-1]``.
    ``max_seq_len`` is the batch's longest sequence as a host int (checked against the block
    table). ``tile_n``/``num_warps``/``num_stages`` override the launch defaults. ``latent_scale``:
    an 8-bit cache's per-token scales (``kernels/kv_quant.py``)."""
    if triton is None:
        raise RuntimeError("mla_decode_swap_ab: Triton is not installed; use mla_attention_ref")
    check_mla_inputs(q_latent, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, min(1, q_latent.shape[0]),
                  max_seq_len, out, latent_scale, name="mla_decode_swap_ab")
    if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
        raise ValueError(f"mla_decode_swap_ab: tile_n must be a power of two >= 16, got {tile_n}")
    if out is None:
        out = torch.empty_like(q_latent)
    num_tokens, num_heads, rank = q_latent.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_r = triton.next_power_of_2(rank)
    block_p = max(16, triton.next_power_of_2(q_pe.shape[2]))
    tiles = _default_tiles(block_r, block_p, q_latent.element_size(), q_latent.device)
    grid = (num_seqs, triton.cdiv(num_heads, _BLOCK_H))
    scaled = latent_scale is not None
    _mla_decode_swap_ab_kernel[grid](
        q_latent, q_pe, latent_cache, latent_scale if scaled else latent_cache, out, block_tables, query_start_loc,
        seq_lens, scale * _LOG2E, num_heads,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), latent_scale.stride(0) if scaled else 0,
        latent_scale.stride(1) if scaled else 0, block_tables.stride(0),
        KV_RANK=rank, ROPE_DIM=q_pe.shape[2], BLOCK_R=block_r, BLOCK_P=block_p,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_H=_BLOCK_H, TILE_N=tile_n or tiles[0],
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", KV_SCALED=scaled,
        KV_LIMIT=quant_limit(latent_cache.dtype) if scaled else 1.0,
        num_warps=num_warps or tiles[1], num_stages=num_stages or tiles[2],
    )
    return out
