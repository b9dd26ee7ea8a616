"""8-bit KV caches (``kernels/kv_quant.py``): the quantizers against their definition, the cache
write kernel against ``reshape_and_cache_ref``, and the attention kernels (one-pass and split-KV)
and the CPU backend against ``paged_attention_ref`` reading int8 and fp8 caches, whose own
dequantization is held to attention over an independently dequantized copy of the cache.

Runs on the CPU through the Triton interpreter. The interpreter converts fp32 to fp8 by truncating
the mantissa and rounding half up without carrying into the exponent, so its fp8 *writes* are
checked only on values the format holds exactly (the scaling, saturation and addressing); the
rounding of arbitrary values is checked against torch by the ``gpu`` tests. fp8 *reads* (widening)
are exact in the interpreter and are tested here in full.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.config import KV_CACHE_DTYPES  # noqa: E402
from deepbatch.kernels import kv_quant  # noqa: E402
from deepbatch.kernels.kv_quant import quantize_fp8_ref, quantize_int8_ref  # noqa: E402
from deepbatch.kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from deepbatch.kernels.paged_attention_torch import paged_attention_torch  # noqa: E402
from deepbatch.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from test_paged_attention import DECODES, MIXED, make_batch  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}
FP8_SCALES = (0.5, 0.25)  # K, V: not 1.0, so a scale applied on the wrong side shows


def test_config_and_kernels_agree_on_the_names():
    assert KV_CACHE_DTYPES == kv_quant.KV_CACHE_DTYPES
    assert kv_quant.kv_cache_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_cache_storage_dtype("fp8", torch.bfloat16) == E4M3
    assert kv_quant.kv_cache_storage_dtype("fp8_e5m2", torch.float32) == E5M2
    assert kv_quant.kv_cache_storage_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.kv_cache_storage_dtype("int4", torch.float32)


# -- the quantizers -----------------------------------------------------------------------------


def test_int8_is_symmetric_absmax_per_vector():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # an all-zero vector
    q, scale = quantize_int8_ref(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50, 3)
    absmax = x.abs().amax(-1)
    torch.testing.assert_close(scale, absmax / 127, rtol=0, atol=0)
    # Each nonzero vector uses the whole range; nothing is off by more than half a step.
    nonzero = absmax > 0
    assert (q.abs().amax(-1)[nonzero] == 127).all()
    assert (q[7, 1] == 0).all() and scale[7, 1] == 0
    err = (q.float() * scale.unsqueeze(-1) - x).abs()
    assert (err <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all()
    # Away from exact ties this is plain round-to-nearest of x / scale.
    plain = torch.round(x / torch.where(nonzero, scale, 1.0).unsqueeze(-1))
    assert (q.float() != plain).float().mean() < 1e-4


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_divides_by_the_scale_and_saturates(dtype):
    limit = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.0, 96.0, limit, 10 * limit, -10 * limit])
    q = quantize_fp8_ref(x, 2.0, dtype)
    assert q.dtype == dtype
    torch.testing.assert_close(q.float(), torch.tensor([0.0, 0.5, -1.5, 48.0, limit / 2, limit, -limit]))


# -- the cache write ----------------------------------------------------------------------------


def make_write_inputs(num_tokens, num_heads, head_dim, block_size, dtype, cache_dtype, values=None):
    """Strided key/value slices of a QKV-like tensor, distinct random slots with every fifth a
    padding slot, caches and scales filled with a sentinel so stray writes show."""
    g = torch.Generator().manual_seed(num_tokens * 7 + head_dim)
    num_blocks = num_tokens // block_size + 3
    qkv = torch.randn(num_tokens, 3 * num_heads, head_dim, generator=g) * 3 if values is None else values
    qkv = qkv.to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1
    shape = (num_blocks, block_size, num_heads, head_dim)
    k_cache = torch.full(shape, 77, dtype=torch.int8 if cache_dtype == torch.int8 else torch.float32).to(cache_dtype)
    scales = None
    if cache_dtype == torch.int8:
        scales = [torch.full(shape[:3], -1.0, device=DEVICE) for _ in range(2)]
    return (qkv[:, num_heads : 2 * num_heads], qkv[:, 2 * num_heads :], k_cache.to(DEVICE), k_cache.clone().to(DEVICE),
            slots.to(DEVICE), scales)


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


def check_write(key, value, k_cache, v_cache, slots, k_scale, v_scale):
    refs = [t.cpu().clone() if torch.is_tensor(t) else t for t in (k_cache, v_cache, k_scale, v_scale)]
    reshape_and_cache_ref(key.cpu(), value.cpu(), refs[0], refs[1], slots.cpu(), refs[2], refs[3])
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), refs):
        if torch.is_tensor(got):
            assert torch.equal(_bits(got.cpu()), _bits(want))
    return refs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 2, 64, 16), (21, 4, 128, 32), (9, 3, 80, 16)], ids=str)
def test_int8_write_matches_reference(dtype, shape):
    key, value, k_cache, v_cache, slots, (k_scale, v_scale) = make_write_inputs(*shape, dtype, torch.int8)
    k_ref, _, ks_ref, _ = check_write(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    valid = slots.cpu() >= 0
    written = ks_ref.view(-1, shape[1])[slots.cpu()[valid]]
    assert (written >= 0).all() and (ks_ref == -1).sum() == ks_ref.numel() - written.numel()
    # The stored vectors dequantize to the inputs within half a step.
    deq = k_ref.view(-1, *shape[1:3])[slots.cpu()[valid]].float() * written.unsqueeze(-1)
    assert ((deq - key.cpu()[valid].float()).abs() <= written.unsqueeze(-1) * 0.5001).all()


def _fp8_exact_values(n, dtype, scale):
    """Random values the fp8 format holds exactly (every bit pattern but NaN/inf), times a power of
    two ``scale``, so ``x / scale`` is exact and needs no rounding."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    vals = bits.view(dtype).float()
    vals = torch.where(vals.isfinite(), vals, 1.0)
    return vals * scale


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_fp8_write_matches_reference_on_representable_values(cache_dtype):
    num_tokens, heads, dim = 24, 2, 64
    k_scale, v_scale = FP8_SCALES
    vals = _fp8_exact_values(num_tokens * 3 * heads * dim, cache_dtype, k_scale).view(num_tokens, 3 * heads, dim)
    vals[:, 2 * heads :] *= v_scale / k_scale
    limit = torch.finfo(cache_dtype).max
    vals[3, heads, :4] = torch.tensor([3 * limit, -3 * limit, limit * k_scale * 1.0001, 1e30])  # saturate
    key, value, k_cache, v_cache, slots, _ = make_write_inputs(num_tokens, heads, dim, 16, torch.float32, cache_dtype,
                                                               values=vals)
    k_ref, _, _, _ = check_write(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    valid = slots.cpu() >= 0
    torch.testing.assert_close(k_ref.view(-1, heads, dim)[slots.cpu()[valid]].float() * k_scale,
                               key.cpu()[valid].clamp(-limit * k_scale, limit * k_scale), rtol=0, atol=0)


def test_write_bad_scales_raise_value_error():
    key, value, k_cache, v_cache, slots, (k_scale, v_scale) = make_write_inputs(8, 2, 64, 16, torch.float32, torch.int8)
    fp8 = torch.zeros(k_cache.shape, dtype=E4M3, device=DEVICE)
    f32 = torch.zeros(k_cache.shape, device=DEVICE)
    for caches, scales, match in (
        ((k_cache, v_cache), (None, None), "int8 cache must be"),
        ((k_cache, v_cache), (k_scale[:, :, :1], v_scale[:, :, :1]), "int8 cache must be"),
        ((k_cache, v_cache), (k_scale.half(), v_scale.half()), "int8 cache must be"),
        ((fp8, fp8.clone()), (k_scale, v_scale), "fp8 cache must be"),
        ((fp8, fp8.clone()), (0.0, 1.0), "fp8 cache must be"),
        ((f32, f32.clone()), (1.0, 1.0), "8-bit caches"),
        ((fp8, f32), (None, None), "dtype"),
    ):
        for fn in (reshape_and_cache, reshape_and_cache_ref):
            with pytest.raises(ValueError, match=match):
                fn(key, value, *caches, slots, *scales)


# -- attention over an 8-bit cache --------------------------------------------------------------


def quantized_batch(lens, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, block_size=16, **kw):
    """``make_batch``'s random batch with its caches stored as ``cache_dtype``, and the same
    caches dequantized to float32 by the format's definition (not by the code under test)."""
    batch, mql, msl = make_batch(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, **kw)
    dequantized = {}
    for name, scale in (("k", FP8_SCALES[0]), ("v", FP8_SCALES[1])):
        x = batch[f"{name}_cache"].float().cpu()
        if cache_dtype == torch.int8:
            q, s = quantize_int8_ref(x)
            dequantized[name] = q.float() * s.unsqueeze(-1)
            batch[f"{name}_scale"] = s.to(DEVICE)
        else:
            q = quantize_fp8_ref(x, scale, cache_dtype)
            dequantized[name] = q.float() * scale
            batch[f"{name}_scale"] = scale
        batch[f"{name}_cache"] = q.to(DEVICE)
    return batch, mql, msl, dequantized


def ref_on_cpu(batch):
    """The reference's inputs on the CPU, the query upcast to float32, the caches as stored."""
    out = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    out["query"] = out["query"].float()
    return out


def reference_over_dequantized(batch, dequantized):
    plain = {k: v for k, v in ref_on_cpu(batch).items() if k not in ("k_scale", "v_scale")}
    return paged_attention_ref(**{**plain, "k_cache": dequantized["k"], "v_cache": dequantized["v"]})


CACHE_DTYPES = [torch.int8, E4M3, E5M2]
CACHE_IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_reference_dequantizes_like_the_format(cache_dtype):
    torch.manual_seed(0)
    batch, _, _, deq = quantized_batch(MIXED, 8, 2, 64, torch.float32, cache_dtype, device="cpu")
    ref = paged_attention_ref(**batch)
    torch.testing.assert_close(ref, reference_over_dequantized(batch, deq), rtol=1e-6, atol=1e-6)
    # The scales matter: read as plain values, the same cache gives something else.
    if cache_dtype == torch.int8:
        unscaled = {**batch, "k_scale": torch.ones_like(batch["k_scale"]), "v_scale": torch.ones_like(batch["v_scale"])}
    else:
        unscaled = {**batch, "k_scale": 1.0, "v_scale": 1.0}
    assert not torch.allclose(paged_attention_ref(**unscaled), ref, atol=1e-3)


def _run_kernel(batch, mql, msl, **kw):
    poisoned = torch.full(batch["query"].shape, float("nan"), dtype=batch["query"].dtype, device=DEVICE)
    return paged_attention(**batch, max_query_len=mql, max_seq_len=msl, out=poisoned, **kw).cpu()


def _assert_matches(out, ref, dtype, batch):
    num_owned = int(batch["query_start_loc"][-1].cpu())
    torch.testing.assert_close(out[:num_owned].float(), ref[:num_owned], **TOL[dtype])
    assert out[num_owned:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128)], ids=["gqa1-d64", "gqa4-d128"])
def test_one_pass_kernel_reads_quantized_cache(dtype, cache_dtype, heads):
    torch.manual_seed(1)
    batch, mql, msl, _ = quantized_batch(MIXED, *heads, dtype, cache_dtype, num_pad_rows=3)
    out = _run_kernel(batch, mql, msl, num_kv_splits=1)
    _assert_matches(out, paged_attention_ref(**ref_on_cpu(batch)), dtype, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_split_kv_decode_reads_quantized_cache(dtype, cache_dtype):
    torch.manual_seed(2)
    batch, mql, msl, _ = quantized_batch(DECODES, 8, 2, 64, dtype, cache_dtype, num_pad_rows=2)
    out = _run_kernel(batch, mql, msl, num_kv_splits=5)
    _assert_matches(out, paged_attention_ref(**ref_on_cpu(batch)), dtype, batch)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "all-decode"])
def test_torch_backend_reads_quantized_cache(cache_dtype, lens):
    torch.manual_seed(3)
    batch, mql, _, deq = quantized_batch([(q, s) for q, s in lens if q > 0], 8, 2, 64, torch.float32, cache_dtype,
                                         device="cpu")
    ref = reference_over_dequantized(batch, deq)
    for max_query_len in (mql, None):
        out = paged_attention_torch(**batch, max_query_len=max_query_len)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_attention_bad_scales_raise_value_error():
    batch, mql, msl, _ = quantized_batch(MIXED, 4, 2, 64, torch.float32, torch.int8)
    for change, match in (
        (dict(k_scale=None, v_scale=None), "int8 cache must be"),
        (dict(v_scale=batch["v_scale"][:, :, :1]), "int8 cache must be"),
        (dict(v_scale=batch["v_scale"].transpose(0, 1).contiguous().transpose(0, 1)), "strides"),
        (dict(k_cache=batch["k_cache"].to(E4M3), v_cache=batch["v_cache"].to(E4M3)), "fp8 cache must be"),
        (dict(v_cache=batch["v_cache"].to(E4M3)), "dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            paged_attention(**{**batch, **change}, max_query_len=mql, max_seq_len=msl)
        with pytest.raises(ValueError, match=match):
            paged_attention_ref(**{k: v for k, v in {**batch, **change}.items()})


# -- on a GPU: bf16 queries, compiled fp8 conversions --------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_write_random_values(cache_dtype, dtype):
    num_tokens, heads, dim, bs = 3000, 8, 128, 16
    key, value, k_cache, v_cache, slots, scales = make_write_inputs(num_tokens, heads, dim, bs, dtype, cache_dtype)
    k_scale, v_scale = scales if scales else FP8_SCALES
    refs = [t.cpu().clone() if torch.is_tensor(t) else t for t in (k_cache, v_cache, k_scale, v_scale)]
    reshape_and_cache_ref(key.cpu(), value.cpu(), refs[0], refs[1], slots.cpu(), refs[2], refs[3])
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    if cache_dtype == torch.int8:
        # 127 / absmax is an approximate division on the GPU: a value within an ulp of a rounding
        # boundary may land one step away.
        for got, want in ((k_cache, refs[0]), (v_cache, refs[1])):
            diff = (got.cpu().int() - want.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-4
        torch.testing.assert_close(k_scale.cpu(), refs[2], rtol=1e-6, atol=0)
        torch.testing.assert_close(v_scale.cpu(), refs[3], rtol=1e-6, atol=0)
    else:
        assert torch.equal(_bits(k_cache.cpu()), _bits(refs[0]))
        assert torch.equal(_bits(v_cache.cpu()), _bits(refs[1]))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("kind", ["mixed", "decode-auto", "decode-split"])
def test_gpu_bf16_large_quantized(cache_dtype, kind):
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    if kind == "mixed":
        lens = [(q, q + randint(0, 4096 - q)) for q in (512, 400, 300, 256, 129, 64, 17)]
        lens += [(q, q) for q in (200, 33)] + [(1, randint(1, 4097)) for _ in range(64)]
    else:
        lens = [(1, 4096), (1, 3001), (1, 777), (1, 1)]
    batch, mql, msl, deq = quantized_batch(lens, 32, 4, 128, torch.bfloat16, cache_dtype)
    out = paged_attention(**batch, max_query_len=mql, max_seq_len=msl,
                          num_kv_splits=8 if kind == "decode-split" else None).float().cpu()
    ref = reference_over_dequantized(batch, deq)
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2, rel
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("splits", [1, 5])
def test_bf16_queries_over_8_bit_caches_take_fp16_dots(cache_dtype, splits):
    """A bf16 query meets an 8-bit cache in fp16 dots (exact widenings of both): it matches the
    reference to the bf16 output's rounding (an ulp is 2**-8 relative)."""
    torch.manual_seed(3)
    lens = DECODES if splits > 1 else MIXED
    batch, mql, msl, _ = quantized_batch(lens, 8, 2, 64, torch.bfloat16, cache_dtype, num_pad_rows=2)
    out = _run_kernel(batch, mql, msl, num_kv_splits=splits)
    num_owned = int(batch["query_start_loc"][-1].cpu())
    torch.testing.assert_close(out[:num_owned].float(), paged_attention_ref(**ref_on_cpu(batch))[:num_owned],
                               atol=2e-2, rtol=1e-2)
