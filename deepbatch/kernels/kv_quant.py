"""8-bit KV cache formats: what each ``kv_cache_dtype`` stores, the quantizers the cache write uses
and the dequantization the attention kernels' torch references apply to gathered blocks.

    kv_cache_dtype     K/V storage        scales
    auto               the model dtype    none
    fp8, fp8_e4m3      float8_e4m3fn      one K and one V scale per layer (host floats: the
    fp8_e5m2           float8_e5m2        checkpoint's k_scale/v_scale, else 1.0); x_q = x / scale
    int8               int8               one per token and KV head, float32, kept beside the
                                          blocks as [num_blocks, block_size, Hkv]; symmetric:
                                          scale = absmax / 127, x_q = round(x / scale)

The MLA latent cache (DeepSeek-V2/V3) keeps ``[c_kv (R) | k_pe (P)]`` per token and quantizes
both 8-bit formats per token: each part gets its own float32 scale (``[num_blocks, block_size, 2]``:
c_kv's, then k_pe's), ``absmax / 127`` for int8 and ``absmax / fp8_max`` for fp8. Two scales, since
c_kv leaves an RMSNorm while k_pe is a rotated projection with no norm, so their ranges need not
match: one absmax over both would let the wider part set the other's step. Per token for fp8 too:
DeepSeek checkpoints carry no KV scales, and a per-token absmax uses the format's whole range
without calibration and never saturates.

Per-token int8 scales need no calibration and keep an outlier token's range from flattening every
other token's. The ``quant mode`` the kernels specialise on is 0 (no scales), 1 (per-layer
floats) or 2 (per-token tensors). The Triton helpers here and the torch functions do the same
fp32 operations in the same order, so the interpreter reproduces the reference bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepbatch.kernels.common import jit as _jit, tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPE = torch.float32  # int8 per-token scales
_STORAGE = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
KV_CACHE_DTYPES = ("auto", *_STORAGE)


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the K/V blocks for a ``kv_cache_dtype`` name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return _STORAGE[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}") from None


def quant_mode(cache_dtype: torch.dtype) -> int:
    return 2 if cache_dtype == torch.int8 else 1 if cache_dtype in FP8_DTYPES else 0


def kv_bytes_per_token_head(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) of one KV head takes in the cache, its scale included."""
    return head_dim * cache_dtype.itemsize + (SCALE_DTYPE.itemsize if quant_mode(cache_dtype) == 2 else 0)


MLA_SCALES_PER_TOKEN = 2  # c_kv, k_pe


def mla_kv_bytes_per_token(rank: int, rope: int, cache_dtype: torch.dtype) -> int:
    """Bytes one token's latent takes in one layer's MLA cache, its two scales included."""
    scales = MLA_SCALES_PER_TOKEN * SCALE_DTYPE.itemsize if quant_mode(cache_dtype) else 0
    return (rank + rope) * cache_dtype.itemsize + scales


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quant_limit(cache_dtype: torch.dtype) -> float:
    """The largest stored magnitude of a per-token scaled 8-bit format (127 for int8): a vector's
    absmax is its scale times this."""
    return 127.0 if cache_dtype == torch.int8 else fp8_max(cache_dtype)


def check_kv_scales(fail: Callable[[str], None], k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale, v_scale) -> tuple[int, float, float]:
    """``(quant mode, K float scale, V float scale)`` after checking that the scales fit the cache
    dtype: none for a 16/32-bit cache; floats > 0 (None means 1.0) for fp8; for int8 two float32
    tensors ``[num_blocks, block_size, Hkv]`` with one set of strides, on the cache's device."""
    mode = quant_mode(k_cache.dtype)
    if v_cache.dtype != k_cache.dtype:
        fail(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if mode == 0:
        if k_scale is not None or v_scale is not None:
            fail(f"k_scale/v_scale are for 8-bit caches, not {k_cache.dtype}")
        return 0, 1.0, 1.0
    if mode == 1:
        scales = [1.0 if s is None else s for s in (k_scale, v_scale)]
        for name, s in zip(("k_scale", "v_scale"), scales):
            if torch.is_tensor(s) or not float(s) > 0 or float(s) == float("inf"):
                fail(f"{name} of an fp8 cache must be a finite float > 0, got {s!r}")
        return 1, float(scales[0]), float(scales[1])
    want = tuple(k_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not torch.is_tensor(s) or s.dtype != SCALE_DTYPE or tuple(s.shape) != want:
            got = f"{s.dtype} {tuple(s.shape)}" if torch.is_tensor(s) else repr(s)
            fail(f"{name} of an int8 cache must be a {SCALE_DTYPE} tensor of shape {want}, got {got}")
        if s.device != k_cache.device:
            fail(f"{name} is on {s.device}, the cache on {k_cache.device}")
    if k_scale.stride() != v_scale.stride():
        fail(f"k_scale and v_scale need one set of strides, got {k_scale.stride()} and {v_scale.stride()}")
    return 2, 1.0, 1.0


def check_latent_scale(fail: Callable[[str], None], latent_cache: torch.Tensor, latent_scale) -> bool:
    """Whether an MLA latent cache is 8-bit, after checking its scales: none for a 16/32-bit
    cache; else a float32 tensor ``[num_blocks, block_size, 2]`` on the cache's device whose two
    scales of a token are adjacent."""
    if quant_mode(latent_cache.dtype) == 0:
        if latent_scale is not None:
            fail(f"latent_scale is for 8-bit latent caches, not {latent_cache.dtype}")
        return False
    want = (*latent_cache.shape[:2], MLA_SCALES_PER_TOKEN)
    if not torch.is_tensor(latent_scale) or latent_scale.dtype != SCALE_DTYPE or tuple(latent_scale.shape) != want:
        got = f"{latent_scale.dtype} {tuple(latent_scale.shape)}" if torch.is_tensor(latent_scale) else repr(latent_scale)
        fail(f"latent_scale of a {latent_cache.dtype} latent cache must be a {SCALE_DTYPE} tensor of shape {want}, "
             f"got {got}")
    if latent_scale.device != latent_cache.device:
        fail(f"latent_scale is on {latent_scale.device}, the cache on {latent_cache.device}")
    if latent_scale.stride(-1) != 1:
        fail(f"latent_scale needs a contiguous last dimension, strides {latent_scale.stride()}")
    return True


class KVScaleArgs:
    """What the attention kernels take for a cache's scales, from :func:`check_kv_scales`'s
    answer: the quant mode, the factor an fp8 K scale puts on the softmax scale, the output
    scale (an fp8 V scale), and the int8 scale tensors and their strides (in the other modes the
    K cache stands in as a pointer that is never read)."""

    def __init__(self, checked: tuple[int, float, float], k_scale, v_scale):
        self.mode, self.k_factor, self.out_scale = checked
        if self.mode == 2:
            self.k_ptr, self.v_ptr, self.strides = k_scale, v_scale, k_scale.stride()
        else:
            self.k_ptr = self.v_ptr = None
            self.strides = (0, 0, 0)

    def pointers(self, k_cache):
        return (self.k_ptr, self.v_ptr) if self.mode == 2 else (k_cache, k_cache)


NO_SCALES = KVScaleArgs((0, 1.0, 1.0), None, None)


# -- torch ------------------------------------------------------------------------------------


def quantize_fp8_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to the format's range (torch would give NaN past it) and rounded
    to nearest even."""
    limit = fp8_max(dtype)
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for ``x [..., D]``: ``q`` int8 in [-127, 127], ``scale [...]`` float32 with
    ``x ~ q * scale``; ties round away from zero. An all-zero vector gets scale 0 and zeros."""
    x = x.float()
    absmax = x.abs().amax(-1)
    # A tensor numerator: ``127.0 / t`` is computed as ``127.0 * (1 / t)``, off by an ulp.
    nonzero = absmax > 0
    inv = torch.where(nonzero, torch.full_like(absmax, 127.0) / torch.where(nonzero, absmax, 1.0), 0.0)
    y = x * inv.unsqueeze(-1)
    y = y + torch.where(y >= 0, 0.5, -0.5)
    return y.clamp(-127.0, 127.0).trunc().to(torch.int8), absmax / 127.0


def quantize_fp8_per_token_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for ``x [..., D]``: ``q`` in the fp8 ``dtype``, ``scale [...]`` float32 =
    absmax / fp8_max with ``x ~ q * scale``; ``q = x * (fp8_max / absmax)``, saturated (the
    product may land an ulp past the maximum) and rounded to nearest even. An all-zero vector gets
    scale 0 and zeros."""
    x = x.float()
    limit = fp8_max(dtype)
    absmax = x.abs().amax(-1)
    nonzero = absmax > 0
    inv = torch.where(nonzero, torch.full_like(absmax, limit) / torch.where(nonzero, absmax, 1.0), 0.0)
    q = (x * inv.unsqueeze(-1)).clamp(-limit, limit).to(dtype)
    return q, absmax / limit


def quantize_latent_ref(c_kv: torch.Tensor, k_pe: torch.Tensor,
                        cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latent [..., R+P] in cache_dtype, scales [..., 2] float32)`` of an 8-bit MLA cache."""
    if cache_dtype == torch.int8:
        (cq, cs), (pq, ps) = quantize_int8_ref(c_kv), quantize_int8_ref(k_pe)
    else:
        (cq, cs), (pq, ps) = quantize_fp8_per_token_ref(c_kv, cache_dtype), quantize_fp8_per_token_ref(k_pe, cache_dtype)
    return torch.cat((cq, pq), -1), torch.stack((cs, ps), -1)


def dequantize_latent_ref(latent: torch.Tensor, scale: torch.Tensor | None, rank: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """Latent-cache entries ``[..., R+P]`` back to ``dtype``; ``scale [..., 2]`` (c_kv's, k_pe's)
    or None for a cache in a 16/32-bit dtype."""
    if scale is None:
        return latent.to(dtype)
    x = latent.float()
    return torch.cat((x[..., :rank] * scale[..., :1], x[..., rank:] * scale[..., 1:]), -1).to(dtype)


def dequantize_ref(x: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements ``x [..., D]`` back to ``dtype``: ``scale`` is None (a 16/32-bit cache),
    a float (fp8) or a tensor ``[...]`` (int8, one per token and head)."""
    if scale is None:
        return x.to(dtype)
    if torch.is_tensor(scale):
        return (x.float() * scale.unsqueeze(-1)).to(dtype)
    return (x.float() * scale).to(dtype)


# -- Triton -----------------------------------------------------------------------------------


@_jit
def fp16_query(q):
    """The query of a dot over 8-bit K/V (or latent) tiles, in fp16: those tiles widen to fp16
    exactly (every int8, e4m3 and e5m2 value is an fp16 value), in one instruction per pair on
    Hopper where bf16 takes several, and a bf16 query converts exactly within fp16's range, to
    which it is clamped. fp16 and fp32 queries are returned as they are."""
    if q.dtype == tl.bfloat16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@_jit
def quantize_int8(x):
    """``(q int8 [R, C], scale fp32 [R])`` of ``x`` fp32 ``[R, C]`` (masked columns 0): the ops of
    :func:`quantize_int8_ref` in its order."""
    absmax = tl.max(tl.abs(x), 1)
    # Correctly rounded, as torch divides (a GPU's default fp32 division is approximate).
    nonzero = absmax > 0
    inv = tl.where(nonzero, tl.math.div_rn(tl.full(absmax.shape, 127.0, tl.float32), tl.where(nonzero, absmax, 1.0)), 0.0)
    y = x * inv[:, None]
    y = y + tl.where(y >= 0, 0.5, -0.5)
    q = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)  # the cast truncates toward zero
    return q, tl.math.div_rn(absmax, tl.full(absmax.shape, 127.0, tl.float32))


@_jit
def quantize_fp8_per_token(x, FP8_MAX: tl.constexpr):
    """``(x / scale saturated, in fp32 [R, C]; scale fp32 [R])`` of ``x`` fp32 ``[R, C]`` (masked
    columns 0): the ops of :func:`quantize_fp8_per_token_ref` in its order; the caller's cast to
    the fp8 type rounds."""
    absmax = tl.max(tl.abs(x), 1)
    limit = tl.full(absmax.shape, FP8_MAX, tl.float32)
    nonzero = absmax > 0
    inv = tl.where(nonzero, tl.math.div_rn(limit, tl.where(nonzero, absmax, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX), FP8_MAX)
    return y, tl.math.div_rn(absmax, limit)
