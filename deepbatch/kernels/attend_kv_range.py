"""The inner loop that the paged attention kernels share: one online-softmax pass of a tile of
packed query rows over a range of keys read through the block table (``paged_attention.py`` runs
it over a whole sequence's keys, ``paged_decode_split_kv.py`` over one split of them)."""

from __future__ import annotations

from deepbatch.kernels.common import jit as _jit
from deepbatch.kernels.common import tl
from deepbatch.kernels.kv_quant import fp16_query

# Scores are kept in log2 units (exp2 is the fast path): the softmax scale is multiplied by this.
LOG2E = 1.4426950408889634


@_jit
def attend_kv_range(
    q, q_pos, m_i, l_i, acc,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, kv_head, kv_start, kv_end, scale_log2e,
    window, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_sb, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    MASKED: tl.constexpr, KV_QUANT: tl.constexpr, SLIDING: tl.constexpr,
):
    """Online-softmax update of ``(m_i, l_i, acc)`` with keys ``kv_start .. kv_end-1``; row ``r``
    sees key ``n`` iff ``n <= q_pos[r]`` (and, ``SLIDING``, ``n > q_pos[r] - window``). ``m_i`` is
    in log2 units (scores scaled by log2 e). ``kv_start`` need not be tile-aligned: tiles are
    ``TILE_N`` keys from it, and no key outside ``[kv_start, kv_end)`` is read.
    ``MASKED=False`` promises whole tiles that every row sees, and skips all masking.
    ``KV_QUANT`` (``kernels/kv_quant.py``): 8-bit tiles meet the query in fp16 dots
    (``fp16_query``): with bf16 operands the widening, not the halved bytes, bounded a decode
    (1.6 TB/s of fp8 KV against 4.0 TB/s of bf16 on an H200, ``benchmarks/attention_sweep.py
    --kv-cache-dtype fp8``). Mode 2 scales score columns by the keys' scales and probabilities
    by the values' (mode 1's per-layer scales the caller folds in)."""
    if KV_QUANT != 0:
        q = fp16_query(q)
    dims = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_start, kv_end, TILE_N):
        k_pos = start + offs_n
        k_valid = k_pos < kv_end
        # Gather by token, not by block: TILE_N and BLOCK_SIZE are then free of each other.
        if MASKED:
            block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        else:
            block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE)
        block = block.to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k_ptrs = k_cache_ptr + (block * stride_kb + in_block * stride_kt + kv_head * stride_kh)[None, :] + dims[:, None]
        v_ptrs = v_cache_ptr + (block * stride_vb + in_block * stride_vt + kv_head * stride_vh)[:, None] + dims[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if KV_QUANT != 0:
            k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, TILE_N]
        if KV_QUANT == 2:
            s_ptrs = block * stride_sb + in_block * stride_st + kv_head * stride_sh
            if MASKED:
                k_s = tl.load(k_scale_ptr + s_ptrs, mask=k_valid, other=0.0)
                v_s = tl.load(v_scale_ptr + s_ptrs, mask=k_valid, other=0.0)
            else:
                k_s = tl.load(k_scale_ptr + s_ptrs)
                v_s = tl.load(v_scale_ptr + s_ptrs)
            s = s * (k_s * scale_log2e)[None, :]
        else:
            s = s * scale_log2e
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
            if SLIDING:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; subtracting 0 avoids inf - inf.
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=k_valid[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if KV_QUANT != 0:
            v = v.to(q.dtype)
        if KV_QUANT == 2:
            p = p * v_s[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc
