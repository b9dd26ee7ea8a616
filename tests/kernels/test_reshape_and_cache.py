"""The Triton cache write held to ``reshape_and_cache_ref``, on the CPU through the Triton interpreter."""

import os

import torch

# The interpreter on the CPU; compiled kernels on CUDA tensors wherever a GPU is present (the
# interpreter's bf16 dot and bf16 rounding are not faithful, so the bf16 tests need a GPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402


def make_inputs(num_tokens, num_heads, head_dim, block_size, dtype, cache_dtype=None, device=DEVICE,
                slot_dtype=torch.int64, num_blocks=None):
    """``key``/``value`` are strided slices of a fused QKV-like tensor; slots are distinct, random,
    with every fifth token padding (-1). The caches start as NaN so stray writes show."""
    num_blocks = num_blocks or (num_tokens // block_size + 3)
    qkv = torch.randn(num_tokens, 3 * num_heads, head_dim, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::5] = -1
    cache_shape = (num_blocks, block_size, num_heads, head_dim)
    cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype, device=device)
    return qkv[:, num_heads : 2 * num_heads], qkv[:, 2 * num_heads :], cache, cache.clone(), slots.to(slot_dtype)


def check(key, value, k_cache, v_cache, slots):
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 2, 64, 16), (21, 4, 128, 32), (9, 3, 80, 16)], ids=str)
def test_matches_reference(dtype, shape):
    torch.manual_seed(0)
    check(*make_inputs(*shape, dtype=dtype))


def test_int32_slots_and_cast_to_cache_dtype():
    torch.manual_seed(1)
    check(*make_inputs(19, 2, 64, 16, torch.float32, cache_dtype=torch.float16, slot_dtype=torch.int32))


def test_all_padding_writes_nothing():
    key, value, k_cache, v_cache, slots = make_inputs(6, 2, 64, 16, torch.float32)
    reshape_and_cache(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize(
    "case",
    ["key-2d", "value-shape", "cache-heads", "slot-length", "slot-float", "dtype-int", "mixed-cache-dtypes",
     "strided-last-dim"],
)
def test_bad_inputs_raise_value_error(case):
    key, value, k_cache, v_cache, slots = make_inputs(8, 2, 64, 16, torch.float32)
    if case == "key-2d":
        key = key.flatten(1)
    elif case == "value-shape":
        value = value[:-1]
    elif case == "cache-heads":
        k_cache, v_cache = k_cache[:, :, :1], v_cache[:, :, :1]
    elif case == "slot-length":
        slots = slots[:-1]
    elif case == "slot-float":
        slots = slots.float()
    elif case == "dtype-int":
        key, value = key.int(), value.int()
    elif case == "mixed-cache-dtypes":
        v_cache = v_cache.half()
    elif case == "strided-last-dim":
        key = key.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError):
        reshape_and_cache(key, value, k_cache, v_cache, slots)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_large():
    torch.manual_seed(2)
    check(*make_inputs(2000, 8, 128, 16, torch.bfloat16, device="cuda", num_blocks=4096))
