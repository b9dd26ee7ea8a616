"""Write new K/V into the paged cache at their slots.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is
``(s // block_size, s % block_size)``. A negative slot marks a padding token (CUDA-graph padding)
and is skipped.
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import jit as _jit, tl, triton


def reshape_and_cache_ref(
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, H, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)



@_jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    # int64 before multiplying: slot * stride overflows int32 on caches past 2**31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    t = token.to(tl.int64)

    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reshape_and_cache(
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, H, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64
) -> None:
    """Triton version of :func:`reshape_and_cache_ref`. ``key``/``value`` may be strided views (a
    slice of a fused QKV projection); every tensor needs a contiguous last dimension."""
    if triton is None:
        raise RuntimeError("reshape_and_cache: Triton is not installed; use reshape_and_cache_ref")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"reshape_and_cache: key and value must be [T, H, D] of one shape, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"reshape_and_cache: caches must be [num_blocks, block_size, H, D] of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_heads, head_dim):
        raise ValueError(f"reshape_and_cache: cache heads/head_dim {tuple(k_cache.shape[2:])} do not match "
                         f"key's {(num_heads, head_dim)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"reshape_and_cache: slot_mapping must be int32/int64 [{num_tokens}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"reshape_and_cache: {name} dtype {t.dtype} is not one of {_FLOAT_DTYPES}")
        if t.stride(-1) != 1:
            raise ValueError(f"reshape_and_cache: {name} needs a contiguous last dimension, strides {t.stride()}")
        if t.device != key.device:
            raise ValueError(f"reshape_and_cache: {name} is on {t.device}, key on {key.device}")
    if value.dtype != key.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError("reshape_and_cache: key/value and k_cache/v_cache must share dtypes")
    if slot_mapping.device != key.device:
        raise ValueError(f"reshape_and_cache: slot_mapping is on {slot_mapping.device}, key on {key.device}")
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )
