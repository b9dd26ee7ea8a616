"""Write new K/V into the paged cache at their slots, quantizing into 8-bit caches.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is
``(s // block_size, s % block_size)``. A negative slot marks a padding token (CUDA-graph padding)
and is skipped. An fp8 cache stores ``x / scale`` with the layer's float K and V scales; an int8
cache stores each (token, head) vector with its own scale, written to ``k_scale``/``v_scale``
``[num_blocks, block_size, num_kv_heads]`` at the same slot (``kernels/kv_quant.py``).

Its MLA twin, :func:`mla_reshape_and_cache`, writes a token's ``c_kv`` and ``k_pe`` side by side
into the latent cache ``[num_blocks, block_size, 1, R + P]``; an 8-bit latent cache gets one
scale per token for each part, in ``latent_scale [num_blocks, block_size, 2]``.
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import jit as _jit, tl, triton
from deepbatch.kernels.kv_quant import (check_kv_scales, check_latent_scale, fp8_max, quantize_fp8_per_token,
                                       quantize_fp8_ref, quantize_int8, quantize_int8_ref, quantize_latent_ref)


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, H, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int
    k_scale: float | torch.Tensor | None = None,  # fp8: float; int8: [N, bs, H] float32 (written)
    v_scale: float | torch.Tensor | None = None,
) -> None:
    mode, k_float, v_float = check_kv_scales(_fail, k_cache, v_cache, k_scale, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for x, cache, scale, scale_f in ((key, k_cache, k_scale, k_float), (value, v_cache, v_scale, v_float)):
        x = x[valid]
        flat = cache.view(-1, *cache.shape[2:])
        if mode == 2:
            q, s = quantize_int8_ref(x)
            flat[slots] = q
            scale.view(-1, scale.shape[2])[slots] = s
        elif mode == 1:
            flat[slots] = quantize_fp8_ref(x, scale_f, cache.dtype)
        else:
            flat[slots] = x.to(cache.dtype)


def _fail(msg: str) -> None:
    raise ValueError(f"reshape_and_cache: {msg}")


@_jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    k_inv_scale, v_inv_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb, stride_st, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    # int64 before multiplying: slot * stride overflows int32 on caches past 2**31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    head_ids = tl.arange(0, BLOCK_H)
    heads = head_ids[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    t = token.to(tl.int64)

    # Masked lanes load 0 so that they never raise an int8 vector's absmax.
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims
    if KV_QUANT == 2:
        kq, ks = quantize_int8(k.to(tl.float32))
        vq, vs = quantize_int8(v.to(tl.float32))
        tl.store(k_dst, kq, mask=mask)
        tl.store(v_dst, vq, mask=mask)
        s_off = block * stride_sb + offset * stride_st + head_ids * stride_sh
        tl.store(k_scale_ptr + s_off, ks, mask=head_ids < NUM_HEADS)
        tl.store(v_scale_ptr + s_off, vs, mask=head_ids < NUM_HEADS)
    elif KV_QUANT == 1:
        kq = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
        vq = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
        tl.store(k_dst, kq.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, vq.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (*_FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def reshape_and_cache(
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, H, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Triton version of :func:`reshape_and_cache_ref`. ``key``/``value`` may be strided views (a
    slice of a fused QKV projection); every tensor needs a contiguous last dimension."""
    if triton is None:
        raise RuntimeError("reshape_and_cache: Triton is not installed; use reshape_and_cache_ref")
    if key.dim() != 3 or value.shape != key.shape:
        _fail(f"key and value must be [T, H, D] of one shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        _fail(f"caches must be [num_blocks, block_size, H, D] of one shape, got "
              f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_heads, head_dim):
        _fail(f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key's {(num_heads, head_dim)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(f"slot_mapping must be int32/int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        allowed = _FLOAT_DTYPES if name in ("key", "value") else _CACHE_DTYPES
        if t.dtype not in allowed:
            _fail(f"{name} dtype {t.dtype} is not one of {allowed}")
        if t.stride(-1) != 1:
            _fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != key.device:
            _fail(f"{name} is on {t.device}, key on {key.device}")
    if value.dtype != key.dtype:
        _fail("key and value must share a dtype")
    mode, k_float, v_float = check_kv_scales(_fail, k_cache, v_cache, k_scale, v_scale)
    if slot_mapping.device != key.device:
        _fail(f"slot_mapping is on {slot_mapping.device}, key on {key.device}")
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    # Modes 0 and 1 read no scale tensor: any pointer will do.
    ks, vs = (k_scale, v_scale) if mode == 2 else (k_cache, k_cache)
    s_strides = k_scale.stride() if mode == 2 else (0, 0, 0)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, ks, vs, slot_mapping,
        1.0 / k_float, 1.0 / v_float,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *s_strides,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], KV_QUANT=mode, FP8_MAX=fp8_max(k_cache.dtype) if mode == 1 else 0.0,
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )


# -- the MLA latent cache ---------------------------------------------------------------------


def _mla_fail(msg: str) -> None:
    raise ValueError(f"mla_reshape_and_cache: {msg}")


def mla_reshape_and_cache_ref(
    c_kv: torch.Tensor,  # [T, R]
    k_pe: torch.Tensor,  # [T, P]
    latent_cache: torch.Tensor,  # [N, bs, 1, R+P]
    slot_mapping: torch.Tensor,  # [T] int
    latent_scale: torch.Tensor | None = None,  # 8-bit caches: [N, bs, 2] float32 (written)
) -> None:
    quantized = check_latent_scale(_mla_fail, latent_cache, latent_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    bs = latent_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs
    if quantized:
        latent, scale = quantize_latent_ref(c_kv[valid], k_pe[valid], latent_cache.dtype)
        latent_scale[blocks, offsets] = scale
    else:
        latent = torch.cat((c_kv[valid], k_pe[valid]), -1)
    latent_cache[blocks, offsets, 0] = latent.to(latent_cache.dtype)


@_jit
def _mla_reshape_and_cache_kernel(
    c_kv_ptr, k_pe_ptr, cache_ptr, scale_ptr, slot_mapping_ptr,
    stride_ct, stride_pt, stride_cb, stride_cs, stride_sb, stride_ss,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """One token. ``KV_QUANT``: 0 stores the cache's dtype, 1 fp8 and 2 int8 with per-token scales."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    # One-row tiles, so that the per-row quantizers of kv_quant apply as they are.
    r = tl.arange(0, BLOCK_R)[None, :]
    p = tl.arange(0, BLOCK_P)[None, :]
    r_ok = r < KV_RANK
    p_ok = p < ROPE_DIM
    t = token.to(tl.int64)
    # Masked lanes load 0 so that they never raise an absmax.
    c = tl.load(c_kv_ptr + t * stride_ct + r, mask=r_ok, other=0.0).to(tl.float32)
    pe = tl.load(k_pe_ptr + t * stride_pt + p, mask=p_ok, other=0.0).to(tl.float32)
    dst = cache_ptr + block * stride_cb + offset * stride_cs
    if KV_QUANT != 0:
        if KV_QUANT == 2:
            c, c_s = quantize_int8(c)
            pe, pe_s = quantize_int8(pe)
        else:
            c, c_s = quantize_fp8_per_token(c, FP8_MAX)
            pe, pe_s = quantize_fp8_per_token(pe, FP8_MAX)
        two = tl.arange(0, 2)
        tl.store(scale_ptr + block * stride_sb + offset * stride_ss + two, tl.where(two == 0, c_s, pe_s))
    tl.store(dst + r, c.to(cache_ptr.dtype.element_ty), mask=r_ok)
    tl.store(dst + KV_RANK + p, pe.to(cache_ptr.dtype.element_ty), mask=p_ok)


def mla_reshape_and_cache(
    c_kv: torch.Tensor,  # [T, R]
    k_pe: torch.Tensor,  # [T, P]
    latent_cache: torch.Tensor,  # [N, bs, 1, R+P]
    slot_mapping: torch.Tensor,  # [T] int32/int64
    latent_scale: torch.Tensor | None = None,  # 8-bit caches: [N, bs, 2] float32 (written)
) -> None:
    """Triton version of :func:`mla_reshape_and_cache_ref`. ``c_kv``/``k_pe`` may be strided
    views (slices of the latent projection); every tensor needs a contiguous last dimension."""
    if triton is None:
        raise RuntimeError("mla_reshape_and_cache: Triton is not installed; use mla_reshape_and_cache_ref")
    if c_kv.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != c_kv.shape[0]:
        _mla_fail(f"c_kv and k_pe must be [T, R] and [T, P], got {tuple(c_kv.shape)} and {tuple(k_pe.shape)}")
    num_tokens, rank = c_kv.shape
    rope = k_pe.shape[1]
    if latent_cache.dim() != 4 or tuple(latent_cache.shape[2:]) != (1, rank + rope):
        _mla_fail(f"latent_cache must be [num_blocks, block_size, 1, R+P={rank + rope}], got {tuple(latent_cache.shape)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        _mla_fail(f"slot_mapping must be int32/int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("c_kv", c_kv), ("k_pe", k_pe), ("latent_cache", latent_cache), ("slot_mapping", slot_mapping)):
        allowed = _FLOAT_DTYPES if name in ("c_kv", "k_pe") else _CACHE_DTYPES if name == "latent_cache" else None
        if allowed is not None and t.dtype not in allowed:
            _mla_fail(f"{name} dtype {t.dtype} is not one of {allowed}")
        if t.stride(-1) != 1:
            _mla_fail(f"{name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != c_kv.device:
            _mla_fail(f"{name} is on {t.device}, c_kv on {c_kv.device}")
    if k_pe.dtype != c_kv.dtype:
        _mla_fail("c_kv and k_pe must share a dtype")
    quantized = check_latent_scale(_mla_fail, latent_cache, latent_scale)
    if num_tokens == 0:
        return
    mode = 0 if not quantized else 2 if latent_cache.dtype == torch.int8 else 1
    scale = latent_scale if quantized else latent_cache  # never read unquantized
    _mla_reshape_and_cache_kernel[(num_tokens,)](
        c_kv, k_pe, latent_cache, scale, slot_mapping.contiguous(),
        c_kv.stride(0), k_pe.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        scale.stride(0) if quantized else 0, scale.stride(1) if quantized else 0,
        KV_RANK=rank, ROPE_DIM=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope),
        BLOCK_SIZE=latent_cache.shape[1], KV_QUANT=mode, FP8_MAX=fp8_max(latent_cache.dtype) if mode == 1 else 0.0,
        num_warps=4 if rank >= 256 else 1,
    )
