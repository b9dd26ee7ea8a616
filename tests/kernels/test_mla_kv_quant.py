"""8-bit MLA latent caches (``kernels/kv_quant.py``): the per-token quantizers against their
definition, the latent write kernel against ``mla_reshape_and_cache_ref``, and the absorbed MLA
kernels (one pass, split-KV, context-only, swap-AB) against ``mla_attention_ref`` reading int8 and
fp8 latents, whose own dequantization is held to attention over a copy of the cache dequantized
here from the formats' definitions.

Runs on the CPU through the Triton interpreter, whose fp32 -> fp8 conversion truncates instead of
rounding to nearest even: fp8 *writes* are checked there on values the format holds exactly after
scaling (addressing, the scales, saturation), and on arbitrary values by the ``gpu`` tests. fp8
*reads* widen exactly and are tested here in full.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels import kv_quant  # noqa: E402
from deepbatch.kernels.mla_decode import mla_attention, mla_attention_ref  # noqa: E402
from deepbatch.kernels.mla_decode_swap_ab import mla_decode_swap_ab  # noqa: E402
from deepbatch.kernels.reshape_and_cache import mla_reshape_and_cache, mla_reshape_and_cache_ref  # noqa: E402
from test_mla_decode import DECODES, MIXED, make_batch, on_cpu  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CACHE_DTYPES = [torch.int8, E4M3, E5M2]
CACHE_IDS = ["int8", "fp8_e4m3", "fp8_e5m2"]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def quantize_by_definition(x: torch.Tensor, cache_dtype: torch.dtype):
    """``(q, scale)`` of each vector of ``x [..., D]``: int8 ``round(x / (absmax / 127))``, fp8
    ``x / (absmax / fp8_max)`` rounded to the format; one float32 scale per vector."""
    x = x.float()
    limit = 127.0 if cache_dtype == torch.int8 else torch.finfo(cache_dtype).max
    scale = x.abs().amax(-1) / limit
    y = x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    q = torch.round(y).clamp(-127, 127).to(torch.int8) if cache_dtype == torch.int8 else y.clamp(-limit, limit).to(cache_dtype)
    return q, scale


def quantize_latents(cache: torch.Tensor, rank: int, cache_dtype: torch.dtype):
    """A float latent cache ``[N, bs, 1, R+P]`` as an 8-bit cache, its scales ``[N, bs, 2]``, and
    that cache dequantized to float32, all by the definition above."""
    (cq, cs), (pq, ps) = (quantize_by_definition(part, cache_dtype) for part in (cache[..., :rank], cache[..., rank:]))
    latent = torch.cat((cq, pq), -1)
    scale = torch.stack((cs[:, :, 0], ps[:, :, 0]), -1)
    dequantized = torch.cat((cq.float() * cs.unsqueeze(-1), pq.float() * ps.unsqueeze(-1)), -1)
    return latent, scale, dequantized


def quantized_batch(lens, num_heads, rank, rope, dtype, cache_dtype, **kw):
    """``make_batch``'s random batch with an 8-bit latent cache whose rotary part is 20 times
    larger than c_kv (as DeepSeek's k_pe outgrows its normed latent), so a scale applied to the
    wrong part shows; and the same cache dequantized by definition (float32, on the CPU)."""
    batch, mql, msl = make_batch(lens, num_heads, rank, rope, block_size=16, dtype=dtype, **kw)
    cache = batch["latent_cache"].float().cpu()
    cache[..., rank:] *= 20
    latent, scale, dequantized = quantize_latents(cache, rank, cache_dtype)
    batch["latent_cache"] = latent.to(DEVICE)
    batch["latent_scale"] = scale.to(DEVICE)
    return batch, mql, msl, dequantized


def reference_over_dequantized(batch, dequantized, **kw):
    plain = {k: v for k, v in on_cpu(batch, torch.float32).items() if k != "latent_scale"}
    plain["latent_cache"] = dequantized
    return mla_attention_ref(**plain, **kw)


def ref_on_cpu(batch):
    """The reference's inputs on the CPU: queries in float32, the cache as stored."""
    out = on_cpu(batch)
    out["q_latent"], out["q_pe"] = out["q_latent"].float(), out["q_pe"].float()
    out["latent_scale"] = batch["latent_scale"].cpu()
    out["latent_cache"] = batch["latent_cache"].cpu()
    return out


# -- the quantizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_per_token_uses_the_whole_range(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 24, generator=g) * torch.logspace(-4, 4, 40).view(40, 1)
    x[5] = 0.0
    q, scale = kv_quant.quantize_fp8_per_token_ref(x, dtype)
    limit = torch.finfo(dtype).max
    assert q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (40,)
    torch.testing.assert_close(scale, x.abs().amax(-1) / limit, rtol=0, atol=0)
    nonzero = scale > 0
    assert (q.float().abs().amax(-1)[nonzero] == limit).all()  # the largest element maps to the maximum
    assert (q[5].float() == 0).all() and scale[5] == 0
    # Every element within half the format's relative step (2^-3 e4m3, 2^-2 e5m2) of its value,
    # whatever the vector's magnitude: no calibration needed, no saturation.
    info = torch.finfo(dtype)
    rel = info.eps / 2
    deq = q.float() * scale.unsqueeze(-1)
    big = x.abs() >= scale.unsqueeze(-1) * info.tiny  # the format's normal range
    assert ((deq - x).abs()[big] <= x.abs()[big] * rel * 1.0001).all()
    torch.testing.assert_close(deq, quantize_by_definition(x, dtype)[0].float() * scale.unsqueeze(-1))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_latent_gets_one_scale_for_c_kv_and_one_for_k_pe(cache_dtype):
    g = torch.Generator().manual_seed(1)
    c_kv, k_pe = torch.randn(9, 32, generator=g), torch.randn(9, 8, generator=g) * 50
    latent, scale = kv_quant.quantize_latent_ref(c_kv, k_pe, cache_dtype)
    assert latent.shape == (9, 40) and latent.dtype == cache_dtype and scale.shape == (9, 2)
    limit = 127.0 if cache_dtype == torch.int8 else torch.finfo(cache_dtype).max
    for part, s, cols in ((c_kv, scale[:, 0], slice(0, 32)), (k_pe, scale[:, 1], slice(32, 40))):
        want_q, want_s = quantize_by_definition(part, cache_dtype)
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
        # Each part spans the whole range on its own, though k_pe is 50 times larger.
        assert (latent[:, cols].float().abs().amax(-1) == limit).all()
        # x * (limit / absmax) and x / (absmax / limit) may differ by an ulp: a rare rounding flips.
        diff = (latent[:, cols].float() - want_q.float()).abs()
        assert (diff > 0).float().mean() < 0.02
        if cache_dtype == torch.int8:
            assert diff.max() <= 1
    deq = kv_quant.dequantize_latent_ref(latent, scale, 32, torch.float32)
    torch.testing.assert_close(deq[:, :32], latent[:, :32].float() * scale[:, :1], rtol=0, atol=0)
    torch.testing.assert_close(deq[:, 32:], latent[:, 32:].float() * scale[:, 1:], rtol=0, atol=0)
    assert kv_quant.mla_kv_bytes_per_token(512, 64, cache_dtype) == 576 + 8
    assert kv_quant.mla_kv_bytes_per_token(512, 64, torch.bfloat16) == 1152


# -- the latent write -------------------------------------------------------------------------


def make_write_inputs(num_tokens, rank, rope, block_size, dtype, cache_dtype, values=None):
    """c_kv and k_pe as strided slices of one projection output, distinct random slots with every
    fifth a padding slot, a cache and scales filled with sentinels so that stray writes show."""
    g = torch.Generator().manual_seed(num_tokens * 7 + rank)
    num_blocks = num_tokens // block_size + 3
    proj = torch.randn(num_tokens, rank + rope + 8, generator=g) * 3 if values is None else values
    proj = proj.to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1
    shape = (num_blocks, block_size, 1, rank + rope)
    cache = torch.full(shape, 77, dtype=torch.int8 if cache_dtype == torch.int8 else torch.float32).to(cache_dtype)
    scale = torch.full((num_blocks, block_size, 2), -1.0) if kv_quant.quant_mode(cache_dtype) else None
    return (proj[:, :rank], proj[:, rank : rank + rope], cache.to(DEVICE), slots.to(DEVICE),
            None if scale is None else scale.to(DEVICE))


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


def check_write(c_kv, k_pe, cache, slots, scale):
    ref_cache = cache.cpu().clone()
    ref_scale = None if scale is None else scale.cpu().clone()
    mla_reshape_and_cache_ref(c_kv.cpu(), k_pe.cpu(), ref_cache, slots.cpu(), ref_scale)
    mla_reshape_and_cache(c_kv, k_pe, cache, slots, scale)
    assert torch.equal(_bits(cache.cpu()), _bits(ref_cache))
    if scale is not None:
        assert torch.equal(scale.cpu(), ref_scale)
    return ref_cache, ref_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 32, 8, 16), (21, 64, 16, 4), (9, 48, 8, 16)], ids=str)
def test_int8_write_matches_reference(dtype, shape):
    c_kv, k_pe, cache, slots, scale = make_write_inputs(*shape, dtype, torch.int8)
    ref_cache, ref_scale = check_write(c_kv, k_pe, cache, slots, scale)
    rank = shape[1]
    valid = slots.cpu() >= 0
    bs = shape[3]
    s = slots.cpu()[valid]
    stored, scales = ref_cache[s // bs, s % bs, 0], ref_scale[s // bs, s % bs]
    assert (scales >= 0).all() and (ref_scale == -1).sum() == ref_scale.numel() - scales.numel()
    # Each part is within half of its own step of the input.
    for part, cols, k in ((c_kv, slice(0, rank), 0), (k_pe, slice(rank, None), 1)):
        deq = stored[:, cols].float() * scales[:, k : k + 1]
        assert ((deq - part.cpu()[valid].float()).abs() <= scales[:, k : k + 1] * 0.5001).all()


def _fp8_exact_rows(num_tokens, width, dtype, g):
    """Rows whose absmax is ``fp8_max * 2^k`` and whose other values are fp8 values times ``2^k``:
    the per-token scale is then ``2^k`` and ``x / scale`` needs no rounding."""
    bits = torch.randint(0, 256, (num_tokens, width), dtype=torch.uint8, generator=g)
    vals = bits.view(dtype).float()
    vals = torch.where(vals.isfinite(), vals, 1.0)
    vals[:, 0] = torch.finfo(dtype).max * torch.where(torch.rand(num_tokens, generator=g) < 0.5, 1.0, -1.0)
    return vals * 2.0 ** torch.randint(-6, 4, (num_tokens, 1), generator=g).float()


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_write_matches_reference_on_representable_values(cache_dtype):
    num_tokens, rank, rope = 24, 32, 8
    g = torch.Generator().manual_seed(3)
    vals = torch.cat((_fp8_exact_rows(num_tokens, rank, cache_dtype, g), _fp8_exact_rows(num_tokens, rope, cache_dtype, g),
                      torch.zeros(num_tokens, 8)), -1)
    vals[4, rank:rank + rope] = 0.0  # an all-zero k_pe: scale 0, zeros
    c_kv, k_pe, cache, slots, scale = make_write_inputs(num_tokens, rank, rope, 16, torch.float32, cache_dtype,
                                                        values=vals)
    ref_cache, ref_scale = check_write(c_kv, k_pe, cache, slots, scale)
    s = slots.cpu()[slots.cpu() >= 0]
    deq = kv_quant.dequantize_latent_ref(ref_cache[s // 16, s % 16, 0], ref_scale[s // 16, s % 16], rank, torch.float32)
    torch.testing.assert_close(deq, vals[slots.cpu() >= 0, : rank + rope], rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_unquantized_write_stores_both_parts(cache_dtype):
    c_kv, k_pe, cache, slots, scale = make_write_inputs(19, 32, 8, 4, torch.float32, cache_dtype)
    ref_cache, _ = check_write(c_kv, k_pe, cache, slots, scale)
    s = slots.cpu()[slots.cpu() >= 0]
    valid = slots.cpu() >= 0
    torch.testing.assert_close(ref_cache[s // 4, s % 4, 0].float(),
                               torch.cat((c_kv.cpu(), k_pe.cpu()), -1)[valid].to(cache_dtype).float(), rtol=0, atol=0)


def test_write_bad_inputs_raise_value_error():
    c_kv, k_pe, cache, slots, scale = make_write_inputs(8, 32, 8, 16, torch.float32, torch.int8)
    f32 = torch.zeros(cache.shape, device=DEVICE)
    fp8 = f32.to(E4M3)
    for args, match in (
        ((c_kv, k_pe, cache, slots, None), "latent_scale of a torch.int8"),
        ((c_kv, k_pe, cache, slots, scale[..., :1]), "latent_scale of a torch.int8"),
        ((c_kv, k_pe, cache, slots, scale.half()), "latent_scale of a torch.int8"),
        ((c_kv, k_pe, fp8, slots, None), "latent_scale of a torch.float8_e4m3fn"),
        ((c_kv, k_pe, f32, slots, scale), "8-bit latent caches"),
        ((c_kv, k_pe, cache, slots, scale.transpose(0, 2).contiguous().transpose(0, 2)), "contiguous"),
        ((c_kv, k_pe, cache[..., :-1], slots, scale), "R\\+P"),
    ):
        with pytest.raises(ValueError, match=match):
            mla_reshape_and_cache(*args)
        if "R\\+P" not in match:
            with pytest.raises(ValueError, match=match):
                mla_reshape_and_cache_ref(*args)


# -- attention over an 8-bit latent cache -----------------------------------------------------


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_reference_dequantizes_like_the_format(cache_dtype):
    torch.manual_seed(0)
    batch, _, _, deq = quantized_batch(MIXED, 4, 32, 8, torch.float32, cache_dtype, device="cpu")
    ref = mla_attention_ref(**batch)
    torch.testing.assert_close(ref, reference_over_dequantized(batch, deq), rtol=1e-6, atol=1e-6)
    # Both scales matter: the same cache read with its two scales swapped gives something else.
    swapped = {**batch, "latent_scale": batch["latent_scale"].flip(-1).contiguous()}
    assert not torch.allclose(mla_attention_ref(**swapped), ref, atol=1e-3)


def _poisoned(batch):
    q = batch["q_latent"]
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def _assert_rows(out, ref, dtype):
    """Rows the reference wrote match; the others stay NaN in both."""
    written = ~ref.isnan().all(-1)
    assert written.any() and out.isnan().all(-1).equal(~written)
    torch.testing.assert_close(out[written].float(), ref[written], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dims", [(4, 32, 8), (20, 48, 8)], ids=["h4-r32-p8", "h20-r48-p8"])
def test_one_pass_kernel_reads_quantized_latents(dims, cache_dtype, dtype):
    """Mixed batches (two tile heights: short and long chunks) through the one-pass kernel."""
    torch.manual_seed(1)
    batch, mql, msl, _ = quantized_batch(MIXED, *dims, dtype, cache_dtype, num_pad_rows=3)
    ref = mla_attention_ref(**ref_on_cpu(batch), out=_poisoned(batch).cpu().float())
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, num_kv_splits=1, out=_poisoned(batch)).cpu()
    _assert_rows(out, ref, dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_split_kv_and_swap_ab_decodes_read_quantized_latents(cache_dtype):
    torch.manual_seed(2)
    batch, mql, msl, _ = quantized_batch(DECODES, 16, 32, 8, torch.float32, cache_dtype, num_pad_rows=2)
    ref = mla_attention_ref(**ref_on_cpu(batch), out=_poisoned(batch).cpu())
    split = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, num_kv_splits=5).cpu()
    owned = int(batch["query_start_loc"][-1])
    written = ~ref[:owned].isnan().all(-1)
    torch.testing.assert_close(split[:owned][written], ref[:owned][written], **TOL[torch.float32])
    swap = mla_decode_swap_ab(**batch, max_seq_len=msl, out=_poisoned(batch), tile_n=16).cpu()
    _assert_rows(swap, ref, torch.float32)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_fp16_decodes_take_swap_ab_over_quantized_latents(cache_dtype, monkeypatch):
    """16-bit one-pass decodes go to the swap-AB kernel, which gets the scales."""
    import deepbatch.kernels.mla_decode_swap_ab as swap_ab

    calls = []
    real = swap_ab.mla_decode_swap_ab
    monkeypatch.setattr(swap_ab, "mla_decode_swap_ab", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    torch.manual_seed(3)
    batch, mql, msl, _ = quantized_batch(DECODES, 4, 32, 8, torch.float16, cache_dtype)
    ref = mla_attention_ref(**ref_on_cpu(batch), out=_poisoned(batch).cpu().float())
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, num_kv_splits=1, out=_poisoned(batch)).cpu()
    assert len(calls) == 1 and calls[0]["latent_scale"] is batch["latent_scale"]
    _assert_rows(out, ref, torch.float16)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
def test_context_mode_reads_quantized_latents(cache_dtype):
    """The expanded prefill's context part: each chunk's cached context and its log-sum-exp."""
    torch.manual_seed(4)
    batch, mql, msl, deq = quantized_batch(MIXED, 4, 32, 8, torch.float32, cache_dtype, num_pad_rows=2)
    shape = batch["q_latent"].shape
    ref_lse = torch.full(shape[:2], float("nan"))
    ref = mla_attention_ref(**ref_on_cpu(batch), out=_poisoned(batch).cpu(), context_lse=ref_lse)
    # The reference's context part over the cache dequantized by definition.
    want_lse = torch.full(shape[:2], float("nan"))
    want = reference_over_dequantized(batch, deq, out=_poisoned(batch).cpu(), context_lse=want_lse)
    torch.testing.assert_close(ref, want, equal_nan=True, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_lse, want_lse, equal_nan=True, rtol=1e-5, atol=1e-5)
    lse = torch.full(shape[:2], float("nan"), device=DEVICE)
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, out=_poisoned(batch), context_lse=lse).cpu()
    written = ~ref_lse.isnan()
    assert written.any() and lse.cpu().isnan().equal(~written)
    torch.testing.assert_close(out, ref, equal_nan=True, **TOL[torch.float32])
    torch.testing.assert_close(lse.cpu()[written], ref_lse[written], **TOL[torch.float32])


def test_attention_bad_scales_raise_value_error():
    batch, mql, msl, _ = quantized_batch(MIXED, 4, 32, 8, torch.float32, torch.int8)
    for change, match in (
        (dict(latent_scale=None), "latent_scale of a torch.int8"),
        (dict(latent_scale=batch["latent_scale"][..., :1]), "latent_scale of a torch.int8"),
        (dict(latent_cache=batch["latent_cache"].float()), "8-bit latent caches"),
    ):
        bad = {**batch, **change}
        with pytest.raises(ValueError, match=match):
            mla_attention(**bad, max_query_len=mql, max_seq_len=msl)
        with pytest.raises(ValueError, match=match):
            mla_decode_swap_ab(**bad, max_seq_len=msl)
        with pytest.raises(ValueError, match=match):
            mla_attention_ref(**bad)


# -- on a GPU: bf16 queries, compiled fp8 conversions -----------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_write_random_values(cache_dtype, dtype):
    c_kv, k_pe, cache, slots, scale = make_write_inputs(3000, 512, 64, 16, dtype, cache_dtype)
    ref_cache, ref_scale = cache.cpu().clone(), scale.cpu().clone()
    mla_reshape_and_cache_ref(c_kv.cpu(), k_pe.cpu(), ref_cache, slots.cpu(), ref_scale)
    mla_reshape_and_cache(c_kv, k_pe, cache, slots, scale)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0, atol=0)
    if cache_dtype == torch.int8:
        # A product within an ulp of a rounding boundary may land one step away.
        diff = (cache.cpu().int() - ref_cache.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-4
    else:
        assert torch.equal(_bits(cache.cpu()), _bits(ref_cache))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("kind", ["mixed", "decode-auto", "decode-split", "context"])
def test_gpu_bf16_deepseek_dims(cache_dtype, kind):
    """DeepSeek-V2-Lite's MLA (16 heads, R = 512, P = 64) over an 8-bit latent cache, against
    the float32 reference over the cache dequantized by definition."""
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    if kind in ("mixed", "context"):
        lens = [(q, q + randint(0, 2048 - q)) for q in (512, 300, 129, 17)]
        lens += [(64, 64)] + [(1, randint(1, 2049)) for _ in range(32)]
    else:
        lens = [(1, 4096), (1, 3001), (1, 777), (1, 1)] + [(1, randint(1, 2049)) for _ in range(32)]
    batch, mql, msl, deq = quantized_batch(lens, 16, 512, 64, torch.bfloat16, cache_dtype)
    kw = dict(context_lse=torch.empty(batch["q_latent"].shape[:2], device="cuda")) if kind == "context" else {}
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl,
                        num_kv_splits=8 if kind == "decode-split" else None, **kw).float().cpu()
    ref_kw = dict(context_lse=torch.empty(batch["q_latent"].shape[:2])) if kind == "context" else {}
    ref = reference_over_dequantized(batch, deq, **ref_kw)
    rows = torch.ones(out.shape[0], dtype=torch.bool)
    if kind == "context":  # rows of chunks with a cached context
        rows = ref_kw["context_lse"][:, 0] > float("-inf")
        qsl = batch["query_start_loc"].tolist()
        for start, end in zip(qsl, qsl[1:]):
            if end - start < 2:
                rows[start:end] = False
    rel = (out[rows] - ref[rows]).norm() / ref[rows].norm()
    assert rel < 2e-2, rel
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS)
@pytest.mark.parametrize("lens", ["mixed", "decodes"])
def test_bf16_queries_over_quantized_latents_take_fp16_dots(cache_dtype, lens):
    """bf16 queries meet 8-bit latents in fp16 dots (the one-pass kernel for mixed batches, the
    swap-AB kernel for decodes): the reference's answer to the bf16 output's rounding."""
    torch.manual_seed(5)
    batch, mql, msl, _ = quantized_batch(MIXED if lens == "mixed" else DECODES, 4, 32, 8, torch.bfloat16, cache_dtype,
                                         num_pad_rows=2)
    ref = mla_attention_ref(**ref_on_cpu(batch), out=_poisoned(batch).cpu().float())
    out = mla_attention(**batch, max_query_len=mql, max_seq_len=msl, num_kv_splits=1, out=_poisoned(batch)).cpu()
    written = ~ref.isnan().all(-1)
    assert written.any() and out.isnan().all(-1).equal(~written)
    torch.testing.assert_close(out[written].float(), ref[written], atol=2e-2, rtol=1e-2)
