"""Write new K/V into the paged cache at their slots, quantizing into 8-bit caches.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is
``(s // block_size, s % block_size)``. A negative slot marks a padding token (CUDA-graph padding)
and is skipped. An fp8 cache stores ``x / scale`` with the layer's float K and V scales; an int8
cache stores each (token, head) vector with its own scale, written to ``k_scale``/``v_scale``
``[num_blocks, block_size, num_kv_heads]`` at the same slot (``kernels/kv_quant.py``).
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import jit as _jit, tl, triton
from deepbatch.kernels.kv_quant import check_kv_scales, fp8_max, quantize_fp8_ref, quantize_int8, quantize_int8_ref


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
