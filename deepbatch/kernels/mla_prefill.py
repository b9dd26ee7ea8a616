"""Expanded MLA attention of prefill chunks over their own new tokens, merged with the absorbed
attention over their cached context.

A chunk of ``q_len`` new tokens behind ``context_len`` cached ones splits its keys in two::

    keys:  0 .......... context_len-1 | context_len ........ seq_len-1
           cached context (latent)    | this step's new tokens
           absorbed, by mla_attention | expanded, here: k = [k_nope | k_pe], v per head,
           (context only) with lse    | decompressed by one kv_b_proj GEMM over the step's tokens

The new tokens' keys and values come from tensors the layer already holds (this step's
``kv_b_proj`` output and rotary key; with an 8-bit latent cache, of the step's latents as the
cache holds them, see ``layers/mla.py``), so the kernel needs no gather and no host-side lengths: its
grid comes from shapes alone, and steps with chunks stay capturable in a CUDA graph. Per key and
head it does ``Dn + P + Dv`` multiply-adds (320 for DeepSeek-V2/V3) against ``2R + P`` (1,088) in
the latent space, and its tiles are ordinary flash-attention tiles: ``BLOCK_M`` query tokens of
one head.

The two halves meet through their log-sum-exps (log2 units)::

    out = (o_new * 2^lse_new + o_ctx * 2^lse_ctx) / (2^lse_new + 2^lse_ctx)

``lse_ctx`` is ``-inf`` for a chunk without cached context (weight 0, and its ``out`` rows are not
read: whatever they hold is replaced). Rows of sequences with
``q_len < 2`` (decodes, absorbed elsewhere) and rows past ``query_start_loc[-1]`` (graph padding)
are left as they are.
"""

from __future__ import annotations

import torch

from deepbatch.kernels.common import check_like, jit as _jit, tl, triton
from deepbatch.kernels.paged_batch import find_seq

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, Dn]
    q_pe: torch.Tensor,  # [T, H, P]
    k_nope: torch.Tensor,  # [T, H, Dn]
    k_pe: torch.Tensor,  # [T, P], shared by the heads
    v: torch.Tensor,  # [T, H, Dv]
    query_start_loc: torch.Tensor,  # [B+1] int
    scale: float,
    out: torch.Tensor,  # [T, H, Dv]: the context part on entry (read only with lse_ctx)
    lse_ctx: torch.Tensor | None = None,  # [T, H] float32, log2 units
) -> torch.Tensor:
    """Plain PyTorch reference, one sequence at a time, in float32; also the CPU backend."""
    qsl = query_start_loc.tolist()
    for qs, qe in zip(qsl, qsl[1:]):
        q_len = qe - qs
        if q_len < 2:
            continue
        rows = slice(qs, qe)
        scores = (torch.einsum("qhd,khd->hqk", q_nope[rows].float(), k_nope[rows].float())
                  + torch.einsum("qhd,kd->hqk", q_pe[rows].float(), k_pe[rows].float())) * scale
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse_new = torch.logsumexp(scores, -1) * _LOG2E  # [H, q_len]
        o_new = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows].float())
        if lse_ctx is not None:
            lse_c = lse_ctx[rows].float().transpose(0, 1)  # [H, q_len]
            m = torch.maximum(lse_new, lse_c)
            w_new = torch.exp2(lse_new - m).transpose(0, 1).unsqueeze(-1)
            w_ctx = torch.exp2(lse_c - m).transpose(0, 1).unsqueeze(-1)
            o_ctx = torch.where(w_ctx > 0, out[rows].float(), 0.0)  # unwritten where there is no context
            o_new = (o_new * w_new + o_ctx * w_ctx) / (w_new + w_ctx)
        out[rows] = o_new.to(out.dtype)
    return out


@_jit
def _attend_new_tokens(
    q_nope, q_pe, m_i, l_i, acc, k_nope_ptr, k_pe_ptr, v_ptr, q_start, q_tok, kv_start, kv_end, head, scale_log2e,
    stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    NOPE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, MASKED: tl.constexpr,
):
    """Online-softmax update with chunk keys ``kv_start .. kv_end-1`` (indices inside the chunk);
    row ``r`` sees key ``n`` iff ``n <= q_tok[r]``. ``MASKED=False`` promises whole tiles that
    every row sees."""
    dn = tl.arange(0, BLOCK_DN)
    dp = tl.arange(0, BLOCK_P)
    dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_start, kv_end, TILE_N):
        k_idx = start + offs_n
        k_valid = k_idx < kv_end
        tok = (q_start + k_idx).to(tl.int64)
        kn_ptrs = k_nope_ptr + (tok * stride_knt + head * stride_knh)[None, :] + dn[:, None]
        kp_ptrs = k_pe_ptr + (tok * stride_kpt)[None, :] + dp[:, None]
        v_ptrs = v_ptr + (tok * stride_vt + head * stride_vh)[:, None] + dv[None, :]
        kn_mask = (dn < NOPE_DIM)[:, None]
        kp_mask = (dp < ROPE_DIM)[:, None]
        v_mask = (dv < V_DIM)[None, :]
        if MASKED:
            kn_mask = kn_mask & k_valid[None, :]
            kp_mask = kp_mask & k_valid[None, :]
            v_mask = v_mask & k_valid[:, None]
        k_nope = tl.load(kn_ptrs, mask=kn_mask, other=0.0)  # [BLOCK_DN, TILE_N]
        k_pe = tl.load(kp_ptrs, mask=kp_mask, other=0.0)  # [BLOCK_P, TILE_N]
        s = tl.dot(q_nope, k_nope, input_precision=PRECISION) + tl.dot(q_pe, k_pe, input_precision=PRECISION)
        s = s * scale_log2e
        if MASKED:
            visible = (k_idx[None, :] <= q_tok[:, None]) & k_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
        # Every row sees key 0 of its chunk in the first tile, so m_new is finite from there on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_ptrs, mask=v_mask, other=0.0)  # [TILE_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# ``out`` is the head-major bmm output seen token-major: its head stride is T * Dv, new every step.
@_jit(do_not_specialize=("num_seqs", "stride_oh"))
def _mla_prefill_kernel(
    q_nope_ptr, q_pe_ptr, k_nope_ptr, k_pe_ptr, v_ptr, out_ptr, lse_ptr, query_start_loc_ptr,
    scale_log2e, num_seqs,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    NOPE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HAS_CONTEXT: tl.constexpr, PRECISION: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    head = tl.program_id(1)
    seq = find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_M + seq)
    if (q_block * BLOCK_M >= q_len) | (q_len < 2):
        return

    q_tok = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = q_tok < q_len
    tok = (q_start + q_tok).to(tl.int64)
    dn = tl.arange(0, BLOCK_DN)
    dp = tl.arange(0, BLOCK_P)
    dv = tl.arange(0, BLOCK_DV)
    q_nope = tl.load(q_nope_ptr + (tok * stride_qnt + head * stride_qnh)[:, None] + dn[None, :],
                     mask=row_valid[:, None] & (dn < NOPE_DIM)[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + (tok * stride_qpt + head * stride_qph)[:, None] + dp[None, :],
                   mask=row_valid[:, None] & (dp < ROPE_DIM)[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Chunk keys [0, full_end): whole tiles before this block's first row, seen by every row.
    #            [full_end, kv_end): the causal diagonal (TILE_N divides BLOCK_M).
    full_end = q_block * BLOCK_M
    kv_end = tl.minimum(q_len, full_end + BLOCK_M)
    m_i, l_i, acc = _attend_new_tokens(
        q_nope, q_pe, m_i, l_i, acc, k_nope_ptr, k_pe_ptr, v_ptr, q_start, q_tok, 0, full_end, head, scale_log2e,
        stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
        NOPE_DIM, ROPE_DIM, V_DIM, BLOCK_DN, BLOCK_P, BLOCK_DV, TILE_N, PRECISION, False,
    )
    m_i, l_i, acc = _attend_new_tokens(
        q_nope, q_pe, m_i, l_i, acc, k_nope_ptr, k_pe_ptr, v_ptr, q_start, q_tok, full_end, kv_end, head, scale_log2e,
        stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
        NOPE_DIM, ROPE_DIM, V_DIM, BLOCK_DN, BLOCK_P, BLOCK_DV, TILE_N, PRECISION, True,
    )
    o = acc / l_i[:, None]  # every valid row saw at least its own key: l_i > 0
    o_ptrs = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + dv[None, :]
    o_mask = row_valid[:, None] & (dv < V_DIM)[None, :]
    if HAS_CONTEXT:
        lse_new = m_i + tl.log2(l_i)
        lse_ctx = tl.load(lse_ptr + tok * stride_lt + head * stride_lh, mask=row_valid, other=float("-inf"))
        m = tl.maximum(lse_new, lse_ctx)
        w_new = tl.exp2(lse_new - m)
        w_ctx = tl.exp2(lse_ctx - m)  # 0 where the chunk has no context (lse_ctx = -inf)
        # Rows without context were never written by the context part: not read.
        o_ctx = tl.load(o_ptrs, mask=o_mask & (lse_ctx > float("-inf"))[:, None], other=0.0).to(tl.float32)
        o = (o * w_new[:, None] + o_ctx * w_ctx[:, None]) / (w_new + w_ctx)[:, None]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def _check_inputs(q_nope, q_pe, k_nope, k_pe, v, query_start_loc, out, lse_ctx, max_query_len):
    def fail(msg):
        raise ValueError(f"mla_prefill: {msg}")

    for name, t, dims in (("q_nope", q_nope, 3), ("q_pe", q_pe, 3), ("k_nope", k_nope, 3), ("k_pe", k_pe, 2),
                          ("v", v, 3), ("out", out, 3)):
        if t.dim() != dims:
            fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    num_tokens, num_heads, nope = q_nope.shape
    rope, dv = q_pe.shape[2], v.shape[2]
    want = {"q_pe": (num_tokens, num_heads, rope), "k_nope": (num_tokens, num_heads, nope),
            "k_pe": (num_tokens, rope), "out": (num_tokens, num_heads, dv), "v": (num_tokens, num_heads, dv)}
    for name, t in (("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("out", out), ("v", v)):
        if tuple(t.shape) != want[name]:
            fail(f"{name} must be {want[name]} (from q_nope {tuple(q_nope.shape)}, q_pe, v), got {tuple(t.shape)}")
    if max(nope, rope, dv) > 256:
        fail(f"head dims must be at most 256, got Dn={nope}, P={rope}, Dv={dv}")
    if q_nope.dtype not in _DTYPES:
        fail(f"q_nope dtype {q_nope.dtype} is not one of {_DTYPES}")
    check_like(fail, "q_nope", q_nope, (("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v), ("out", out)))
    if lse_ctx is not None and (lse_ctx.dtype != torch.float32 or tuple(lse_ctx.shape) != (num_tokens, num_heads)
                                or lse_ctx.device != q_nope.device):
        fail(f"lse_ctx must be float32 [{num_tokens}, {num_heads}] on {q_nope.device}, got {lse_ctx.dtype} "
             f"{tuple(lse_ctx.shape)} on {lse_ctx.device}")
    if (query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 or query_start_loc.stride(0) != 1
            or query_start_loc.device != q_nope.device):
        fail(f"query_start_loc must be contiguous int32 [B+1] on {q_nope.device}")
    if max_query_len < 0 or max_query_len > num_tokens:
        fail(f"max_query_len {max_query_len} outside [0, T={num_tokens}]")


def mla_prefill(
    q_nope: torch.Tensor,  # [T, H, Dn]
    q_pe: torch.Tensor,  # [T, H, P]
    k_nope: torch.Tensor,  # [T, H, Dn]
    k_pe: torch.Tensor,  # [T, P]
    v: torch.Tensor,  # [T, H, Dv]
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor,  # [T, H, Dv]
    lse_ctx: torch.Tensor | None = None,  # [T, H] float32
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`mla_prefill_ref` (same semantics; module docstring), in place in
    ``out``. ``max_query_len`` is the batch's longest q_len as a host int (a CUDA graph passes its
    size): it picks the tile height only. Any tensor may be a strided view with a contiguous last
    dim (``q_nope``/``q_pe`` of the query projection, ``k_pe`` of the latent)."""
    if triton is None:
        raise RuntimeError("mla_prefill: Triton is not installed; use mla_prefill_ref")
    _check_inputs(q_nope, q_pe, k_nope, k_pe, v, query_start_loc, out, lse_ctx, max_query_len)
    num_tokens, num_heads, nope = q_nope.shape
    rope, dv = q_pe.shape[2], v.shape[2]
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0 or max_query_len < 2:
        return out
    wide = q_nope.element_size() == 2
    if block_m is None:
        block_m = max(16, min(128 if wide else 64, triton.next_power_of_2(max_query_len)))
    if tile_n is None:
        tile_n = min(block_m, 64 if wide else 32)
    if block_m % tile_n:
        raise ValueError(f"mla_prefill: tile_n {tile_n} must divide block_m {block_m}")
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 3 if wide else 2
    grid = (num_tokens // block_m + num_seqs, num_heads)
    lse = lse_ctx if lse_ctx is not None else out  # never read without a context part
    _mla_prefill_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, v, out, lse, query_start_loc,
        scale * _LOG2E, num_seqs,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0) if lse_ctx is not None else 0, lse.stride(1) if lse_ctx is not None else 0,
        NOPE_DIM=nope, ROPE_DIM=rope, V_DIM=dv,
        BLOCK_DN=max(16, triton.next_power_of_2(nope)), BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BLOCK_M=block_m, TILE_N=tile_n,
        HAS_CONTEXT=lse_ctx is not None, PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
