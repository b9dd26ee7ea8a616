"""Neox-style rotary embedding (``rotate_half``) of q and k in one launch, in place.

Over the first ``rotary_dim`` dims of every head, with ``x1, x2`` its two halves and ``c, s`` the
token's half tables ``cos, sin [T, rot/2]``::

    out = [x1*c - x2*s | x2*c + x1*s]        (dims past rotary_dim pass through)

which is transformers' ``x*cos + rotate_half(x)*sin`` written without the concatenations. In
torch that is a cat, a neg, two muls, an add and copies per tensor and per layer; the kernel is
one program per token over all q and k heads, reading each half table once.

Models that normalise each head before the rotation (Qwen3's ``q_norm``/``k_norm``) pass the two
RMSNorm weights: the kernel normalises every head in the same pass (what ``rms_norm`` computes,
rounding points included), saving two norm launches and the copies that feed them per layer.
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import jit as _jit, tl, triton


def neox_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Half tables ``[T, rot/2]`` in ``rotate_half``'s layout, ``[T, 1, rot]`` in ``dtype``."""
    return torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype), torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """``x [T, H, D]`` rotated by full tables ``[T, 1, rot]`` (:func:`neox_tables`); a new tensor."""
    # Same arithmetic order as transformers' apply_rotary_pos_emb: x*cos + rotate_half(x)*sin, in
    # x's dtype (cos/sin come cast to it), so fp32 outputs match the reference bit for bit.
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out


def rotary_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [T, rot/2]
    sin: torch.Tensor,  # [T, rot/2]
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``(q, k)`` as new tensors, in q's dtype throughout (the tables are cast to it)."""
    cos_full, sin_full = neox_tables(cos, sin, q.dtype)
    return rotate_neox(q, cos_full, sin_full, rotary_dim), rotate_neox(k, cos_full, sin_full, rotary_dim)


@_jit
def _rotate_heads(
    x_ptr, stride_h, c, s, w_ptr, eps,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rotates the first ``2*HALF`` dims of one token's ``NUM_HEADS`` heads, ``BLOCK_H`` at a time;
    with ``HAS_NORM`` (then ``2*HALF`` is the whole head) each head is RMS-normalised first."""
    dims = tl.arange(0, BLOCK_R)
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
        p1 = x_ptr + heads[:, None] * stride_h + dims[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if HAS_NORM:
            # rms_norm's rounding: normalised in fp32, rounded to x's dtype, times the weight, rounded.
            rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
            a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
            b = ((b * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
        tl.store(p1, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(p1 + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


# No argument varies with the batch (the token count is the grid), so nothing here needs
# ``do_not_specialize``: one compiled variant per model shape.
@_jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_R)
    mask = dims < HALF
    c = tl.load(cos_ptr + t * stride_ct + dims, mask=mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + dims, mask=mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, c, s, q_norm_ptr, eps, NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_R,
                  HAS_NORM)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, c, s, k_norm_ptr, eps, NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_R,
                  HAS_NORM)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 2048  # elements of one half per head block: bounds the registers whatever the head count


def rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [T, rot/2]
    sin: torch.Tensor,  # [T, rot/2]
    rotary_dim: int,
    q_norm: torch.Tensor | None = None,  # [D]
    k_norm: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rotary_ref`, or with ``q_norm``/``k_norm`` (RMSNorm weights, both or
    neither; ``rotary_dim`` must then be the head dim) of ``rotary_ref(rms_norm_ref(q, q_norm,
    eps), rms_norm_ref(k, k_norm, eps), ...)``. Rotates ``q`` and ``k`` **in place** and returns them:
    the attention layers hand over views of their fused qkv projection that nothing else reads
    unrotated, so there is no output to allocate and the pass-through dims are never touched.
    ``q``/``k`` may be strided views (token and head strides free; last dim contiguous).

    The arithmetic runs in float32 on the float32 tables and rounds once, so fp16/bf16 results are
    not bit-identical to the reference's (which rounds each product and the sum to the input
    dtype, with the tables rounded too); fp32 agrees within 1e-6 relative (the GPU may fuse
    multiply-adds). Shapes alone set the grid and nothing syncs: capturable in a CUDA graph."""
    if triton is None:
        raise RuntimeError("rotary: Triton is not installed; use rotary_ref")

    def fail(msg: str):
        raise ValueError(f"rotary: {msg}")

    if q.dim() != 3 or k.dim() != 3 or q.dtype not in _DTYPES:
        fail(f"q [T, Hq, D] and k [T, Hk, D] must be float tensors of {_DTYPES}, got "
             f"{q.dtype} {tuple(q.shape)} and {k.dtype} {tuple(k.shape)}")
    num_tokens = q.shape[0]
    if k.dtype != q.dtype or k.device != q.device or k.shape[0] != num_tokens:
        fail(f"k {k.dtype} {tuple(k.shape)} on {k.device} must match q {q.dtype} {tuple(q.shape)} on {q.device}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > min(q.shape[2], k.shape[2]):
        fail(f"rotary_dim {rotary_dim} must be even and within the head dims {q.shape[2]}, {k.shape[2]}")
    half = rotary_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (num_tokens, half) or t.dtype not in _DTYPES:
            fail(f"{name} must be a float [T={num_tokens}, rot/2={half}], got {t.dtype} {tuple(t.shape)}")
        if t.device != q.device:
            fail(f"{name} is on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
    has_norm = q_norm is not None or k_norm is not None
    if has_norm:
        if q_norm is None or k_norm is None:
            fail("q_norm and k_norm come together")
        if not rotary_dim == q.shape[2] == k.shape[2]:
            fail(f"normalising heads needs rotary_dim == head_dim, got {rotary_dim} for {q.shape[2]}, {k.shape[2]}")
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w.shape != (rotary_dim,) or w.dtype not in _DTYPES or w.device != q.device or w.stride(0) != 1:
                fail(f"{name} must be a contiguous float [{rotary_dim}] on {q.device}, got {w.dtype} "
                     f"{tuple(w.shape)} on {w.device}")

    if num_tokens:
        block_r = triton.next_power_of_2(half)
        max_heads = max(1, _TILE // block_r)
        _rotary_kernel[(num_tokens,)](
            q, k, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half,
            BLOCK_HQ=min(triton.next_power_of_2(q.shape[1]), max_heads),
            BLOCK_HK=min(triton.next_power_of_2(k.shape[1]), max_heads),
            BLOCK_R=block_r, HAS_NORM=has_norm, num_warps=4,
        )
    return q, k
