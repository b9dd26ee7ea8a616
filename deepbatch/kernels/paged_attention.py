"""Attention over the paged KV cache for a mixed batch of prefill chunks and decodes.

Sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` (``q_len`` rows) and
has ``seq_len = seq_lens[i]`` tokens in the cache, the new ones included. Its query rows are the
last ``q_len`` positions of the sequence::

    keys:     0 ............................. seq_len-1
    queries:                      [seq_len-q_len ... seq_len-1]
    row j attends to keys 0 .. seq_len - q_len + j   (causal inside the chunk, full over context)

A decode is ``q_len == 1``; a chunked prefill or a prefix-cache hit is ``q_len < seq_len``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one sequence: ``[seq_len, H, D]``."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    return cache[block_table[:nb].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B+1] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference, one sequence at a time, in float32."""
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
        q = query[qs:qe].float().transpose(0, 1)  # [Hq, q_len, D]
        k = gather_kv(k_cache, block_tables[i], seq_len).float().transpose(0, 1)  # [Hkv, L, D]
        v = gather_kv(v_cache, block_tables[i], seq_len).float().transpose(0, 1)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores = (q @ k.transpose(1, 2)) * scale  # [Hq, q_len, L]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out[qs:qe] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
    return out


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
) -> torch.Tensor:
    """The CPU backend: the reference's semantics through SDPA. Decode rows (``q_len == 1``) of
    the whole batch go through one padded SDPA call; prefill chunks go one sequence at a time."""
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    if max_query_len == 1 or (max_query_len is None and query.shape[0] == num_seqs):
        return _decode_batched(query, k_cache, v_cache, block_tables, seq_lens, scale, out)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        qs, qe = qsl[i], qsl[i + 1]
        q_len = qe - qs
        if q_len == 0:
            continue
        q = query[qs:qe].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        k = gather_kv(k_cache, block_tables[i], seq_len).transpose(0, 1).unsqueeze(0)
        v = gather_kv(v_cache, block_tables[i], seq_len).transpose(0, 1).unsqueeze(0)
        if q_len == seq_len:
            mask, causal = None, q_len > 1
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            mask, causal = torch.arange(seq_len).unsqueeze(0) <= q_pos, False
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def _decode_batched(query, k_cache, v_cache, block_tables, seq_lens, scale, out):
    bs = k_cache.shape[1]
    max_len = int(seq_lens.max())
    nb = -(-max_len // bs)
    tables = block_tables[:, :nb].long()
    k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    mask = torch.arange(max_len, device=query.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    out.copy_(o.squeeze(2))
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # the torch paths above stay usable without Triton (CPU-only installs)
    triton = tl = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


# Every program of the kernels below handles one KV head and the ``G = Hq // Hkv`` query heads that
# share it, packed as rows of one tile so that each K/V tile is loaded once for the whole group:
#
#     row r  ->  query token  q_block * BLOCK_Q + r // G,   query head  kv_head * G + r % G
#
# Rows past ``BLOCK_Q * G`` or past the chunk's end are masked.


@_jit
def _attend_kv_range(
    q, q_pos, m_i, l_i, acc,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, kv_start, kv_end, scale_log2e,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online-softmax update of ``(m_i, l_i, acc)`` with keys ``kv_start .. kv_end-1``; row ``r``
    sees key ``n`` iff ``n <= q_pos[r]``. ``m_i`` is in log2 units (scores scaled by log2 e)."""
    dims = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_start, kv_end, TILE_N):
        k_pos = start + offs_n
        k_valid = k_pos < kv_end
        # Gather by token, not by block: TILE_N and BLOCK_SIZE are then free of each other.
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        k_off = block * stride_kb + in_block * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[None, :] + dims[:, None], mask=k_valid[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2e  # [BLOCK_M, TILE_N]
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + in_block * stride_vt + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=k_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@_jit
def _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flat q block ``q_block_global``. Sequence ``i``'s blocks start at
    ``query_start_loc[i] // BLOCK_Q + i``: strictly increasing, and each sequence gets at least
    ``cdiv(q_len, BLOCK_Q)`` of them, so ``T // BLOCK_Q + B`` blocks cover any batch."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_global:
            lo = mid
        else:
            hi = mid - 1
    return lo


@_jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2e, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
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
    # Keys past the tile's last query are invisible to all of its rows.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend_kv_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, 0, kv_end,
        scale_log2e, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        HEAD_DIM, BLOCK_SIZE, TILE_N, PRECISION,
    )
    # l_i == 0 only for a sequence with no keys (seq_len 0): the reference gives zeros there.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + q_tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len, out):
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
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is None:
            continue
        if t.dtype != query.dtype:
            fail(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.stride(-1) != 1:
            fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != query.device:
            fail(f"{name} is on {t.device}, query on {query.device}")
    if out is not None and out.shape != query.shape:
        fail(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (
        ("seq_lens", seq_lens, (num_seqs,)),
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("block_tables", block_tables, (num_seqs, block_tables.shape[-1])),
    ):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            fail(f"{name} must be int32 of shape {shape} (B = len(seq_lens)), got {t.dtype} {tuple(t.shape)}")
        if t.stride(-1) != 1:
            fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != query.device:
            fail(f"{name} is on {t.device}, query on {query.device}")
    if max_query_len < 0 or max_query_len > query.shape[0]:
        fail(f"max_query_len {max_query_len} outside [0, T={query.shape[0]}]")
    if max_seq_len > block_tables.shape[1] * k_cache.shape[1]:
        fail(f"max_seq_len {max_seq_len} exceeds block_tables capacity "
             f"{block_tables.shape[1]} blocks x {k_cache.shape[1]} tokens")


_num_sms_cache: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100/H200: keeps the path choice under the interpreter the same as on a GPU
    if device not in _num_sms_cache:
        _num_sms_cache[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _num_sms_cache[device]


def _choose_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split when the (seq, kv head) programs leave most SMs idle and each split still streams a
    few hundred keys; aim at about two programs per SM."""
    programs = num_seqs * num_kv_heads
    num_sms = _num_sms(device)
    if programs == 0 or programs * 2 > num_sms:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), max_seq_len // 256, 64)
    return max(splits, 1)


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
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_ref` (same semantics; module docstring).

    ``max_query_len`` and ``max_seq_len`` are the batch's maxima as host ints (no device sync);
    they pick tile shapes and the path, never correctness, except that ``max_query_len == 1``
    with a split promises every sequence has ``q_len <= 1``. ``num_kv_splits``: ``None`` picks
    by heuristic; ``1`` forces the one-pass kernel; ``> 1`` forces the split-KV decode path (only
    for ``max_query_len <= 1``). Rows past ``query_start_loc[-1]`` (CUDA-graph padding) are not
    written. head_dim must be a power of two in [16, 256]; any block_size works."""
    if triton is None:
        raise RuntimeError("paged_attention: Triton is not installed; use paged_attention_torch")
    _check_inputs(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_query_len, max_seq_len, out)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    precision = "ieee" if query.dtype == torch.float32 else "tf32"

    if num_kv_splits is None:
        num_kv_splits = 1
        if max_query_len <= 1:
            num_kv_splits = _choose_kv_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    if num_kv_splits > 1:
        if max_query_len > 1:
            raise ValueError(f"paged_attention: num_kv_splits={num_kv_splits} needs max_query_len <= 1, "
                             f"got {max_query_len}")
        from deepbatch.kernels.paged_decode_split_kv import paged_decode_split_kv

        return paged_decode_split_kv(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, num_kv_splits, out,
        )

    # Tile shape comes from bucketed batch maxima, so a serving loop compiles a handful of variants.
    block_m = max(16, triton.next_power_of_2(queries_per_kv))
    if max_query_len > 1:
        cap = 128 if head_dim <= 128 else 64
        block_m = max(block_m, min(cap, triton.next_power_of_2(max_query_len * queries_per_kv)))
    block_q = block_m // queries_per_kv
    tile_n = 64 if head_dim <= 128 else 32
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale * _LOG2E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n, PRECISION=precision,
        num_warps=8 if block_m >= 128 else 4, num_stages=2,
    )
    return out
