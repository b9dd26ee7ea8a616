"""The expanded MLA prefill kernel held to ``mla_prefill_ref``, and both held to plain attention:
a chunk's attention over its new tokens, merged with a context part through the context's
log-sum-exp, is its causal attention over context and new keys together. Runs on the CPU through
the Triton interpreter; the bf16 test needs a GPU."""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.mla_prefill import mla_prefill, mla_prefill_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}

# q_len per sequence (decodes and an empty sequence among chunks) and its cached context length.
LENS = [(7, 0), (1, 12), (40, 9), (0, 3), (2, 0), (19, 30), (1, 1), (33, 0)]


def make_inputs(lens, heads, nope, rope, dv, dtype, device=DEVICE, num_pad_rows=0, seed=0):
    """Strided views as the layer passes them: q_nope/q_pe of one projection, k_nope/v of one
    ``kv_b_proj`` output, k_pe of the latent; plus an independent context part per chunk
    (expanded keys and values) and its attention ``o_ctx``, ``lse_ctx``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q_lens = [q for q, _ in lens]
    num_tokens = sum(q_lens) + num_pad_rows
    q = randn(num_tokens, heads, nope + rope + 8)
    kv = randn(num_tokens, heads, nope + dv)
    latent = randn(num_tokens, 1, 24 + rope)
    scale = (nope + rope) ** -0.5
    o_ctx = randn(num_tokens, heads, dv)
    lse_ctx = torch.full((num_tokens, heads), float("-inf"))
    contexts = []
    start = 0
    for q_len, ctx in lens:
        rows = slice(start, start + q_len)
        kc, kpc, vc = randn(ctx, heads, nope), randn(ctx, rope), randn(ctx, heads, dv)
        contexts.append((kc, kpc, vc))
        if q_len >= 2:
            scores = (torch.einsum("qhd,khd->hqk", q[rows, :, :nope].float(), kc.float())
                      + torch.einsum("qhd,kd->hqk", q[rows, :, nope:nope + rope].float(), kpc.float())) * scale
            if ctx:
                o_ctx[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vc.float()).to(dtype)
            else:  # nothing computed it: must not be read
                o_ctx[rows] = float("nan")
            lse_ctx[rows] = (torch.logsumexp(scores, -1) / math.log(2)).transpose(0, 1)
        start += q_len
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    t = dict(q_nope=q[..., :nope], q_pe=q[..., nope:nope + rope], k_nope=kv[..., :nope], k_pe=latent[:, 0, 24:],
             v=kv[..., nope:], query_start_loc=qsl, scale=scale)
    t = {k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()}
    return t, o_ctx.to(device), lse_ctx.to(device), contexts


def full_attention(inputs, lens, contexts):
    """Each chunk's causal attention over its context and new keys at once, in float32."""
    out = {}
    start = 0
    for (q_len, ctx), (kc, kpc, vc) in zip(lens, contexts):
        rows = slice(start, start + q_len)
        start += q_len
        if q_len < 2:
            continue
        f = {k: v[rows].float().cpu() for k, v in inputs.items() if torch.is_tensor(v) and k != "query_start_loc"}
        k_nope = torch.cat((kc.float(), f["k_nope"]))
        k_pe = torch.cat((kpc.float(), f["k_pe"]))
        v = torch.cat((vc.float(), f["v"]))
        scores = (torch.einsum("qhd,khd->hqk", f["q_nope"], k_nope)
                  + torch.einsum("qhd,kd->hqk", f["q_pe"], k_pe)) * inputs["scale"]
        visible = torch.arange(ctx + q_len)[None, :] <= torch.arange(ctx, ctx + q_len)[:, None]
        out[(rows.start, rows.stop)] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf"))
                                                    .softmax(-1), v)
    return out


@pytest.mark.parametrize("with_context", [True, False])
def test_reference_is_causal_attention_over_context_and_new_keys(with_context):
    torch.manual_seed(0)
    lens = LENS if with_context else [(q, 0) for q, _ in LENS]
    inputs, o_ctx, lse_ctx, contexts = make_inputs(lens, 3, 16, 8, 12, torch.float32, device="cpu")
    out = mla_prefill_ref(**inputs, out=o_ctx.clone(), lse_ctx=lse_ctx if with_context else None)
    for (a, b), want in full_attention(inputs, lens, contexts).items():
        torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", [(3, 16, 8, 16), (4, 24, 8, 12), (2, 32, 16, 32)],
                         ids=["dn16-p8-dv16", "dn24-p8-dv12", "dn32-p16-dv32"])
@pytest.mark.parametrize("block_m", [None, 16])
def test_kernel_matches_reference(dtype, dims, block_m):
    """Chunks longer than a tile (block_m 16 against q_len 40), non-power-of-two dims, decodes
    and padding rows left as they were (poisoned with NaN)."""
    inputs, o_ctx, lse_ctx, _ = make_inputs(LENS, *dims, dtype, num_pad_rows=3, seed=1)
    owned = torch.zeros(o_ctx.shape[0], dtype=torch.bool)
    start = 0
    for q_len, _ in LENS:
        owned[start:start + q_len] = q_len >= 2
        start += q_len
    base = o_ctx.clone()
    base[~owned.to(base.device)] = float("nan")
    ref = mla_prefill_ref(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in inputs.items()},
                          out=base.cpu().clone(), lse_ctx=lse_ctx.cpu())
    out = mla_prefill(**inputs, max_query_len=max(q for q, _ in LENS), out=base.clone(), lse_ctx=lse_ctx,
                      block_m=block_m).cpu()
    torch.testing.assert_close(out[owned], ref[owned], **TOL[dtype])
    assert out[~owned].isnan().all()


def test_kernel_without_context_matches_reference():
    inputs, o_ctx, _, _ = make_inputs(LENS, 2, 16, 16, 16, torch.float32, seed=2)
    ref = mla_prefill_ref(**inputs, out=o_ctx.clone())
    out = mla_prefill(**inputs, max_query_len=40, out=o_ctx.clone(), block_m=32, tile_n=16)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_only_batch_is_left_alone():
    inputs, o_ctx, lse_ctx, _ = make_inputs([(1, 3), (1, 0), (0, 2)], 2, 16, 8, 16, torch.float32)
    out = mla_prefill(**inputs, max_query_len=1, out=o_ctx.clone(), lse_ctx=lse_ctx)
    assert out.equal(o_ctx)


def _bad(inputs, o_ctx, lse_ctx):
    return {
        "q-pe-heads": dict(inputs, q_pe=inputs["q_pe"][:, :1]),
        "k-pe-per-head": dict(inputs, k_pe=inputs["k_pe"].unsqueeze(1)),
        "v-dtype": dict(inputs, v=inputs["v"].double()),
        "qsl-int64": dict(inputs, query_start_loc=inputs["query_start_loc"].long()),
        "strided-last-dim": dict(inputs, k_nope=inputs["k_nope"].transpose(0, 2).contiguous().transpose(0, 2)),
        "lse-shape": dict(inputs, lse_ctx=lse_ctx[:, :1]),
        "lse-dtype": dict(inputs, lse_ctx=lse_ctx.half()),
        "out-width": dict(inputs, out=o_ctx[..., :-1]),
        "head-dim-512": dict(inputs, q_nope=torch.zeros(*inputs["q_nope"].shape[:2], 512),
                             k_nope=torch.zeros(*inputs["q_nope"].shape[:2], 512)),
    }


@pytest.mark.parametrize("case", ["q-pe-heads", "k-pe-per-head", "v-dtype", "qsl-int64", "strided-last-dim",
                                  "lse-shape", "lse-dtype", "out-width", "head-dim-512"])
def test_bad_inputs_raise_value_error(case):
    inputs, o_ctx, lse_ctx, _ = make_inputs(LENS, 2, 16, 8, 16, torch.float32, device="cpu")
    args = dict(inputs, out=o_ctx, lse_ctx=lse_ctx)
    args.update(_bad(inputs, o_ctx, lse_ctx)[case])
    with pytest.raises(ValueError, match="mla_prefill"):
        mla_prefill(**args, max_query_len=40)
    with pytest.raises(ValueError, match="tile_n"):
        mla_prefill(**inputs, out=o_ctx, lse_ctx=lse_ctx, max_query_len=40, block_m=32, tile_n=64)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_m", [None, 64])
def test_gpu_bf16_deepseek_dims(block_m):
    """DeepSeek-V2-Lite's heads: 16 heads, Dn = 128, P = 64, Dv = 128; chunks up to 1,024 tokens."""
    lens = [(1024, 0), (300, 700), (1, 900), (129, 0), (17, 2000), (2, 5)] + [(1, 64)] * 8
    inputs, o_ctx, lse_ctx, contexts = make_inputs(lens, 16, 128, 64, 128, torch.bfloat16, seed=3)
    out = mla_prefill(**inputs, max_query_len=1024, out=o_ctx.clone(), lse_ctx=lse_ctx, block_m=block_m).float().cpu()
    for (a, b), want in full_attention(inputs, lens, contexts).items():
        rel = (out[a:b] - want).norm() / want.norm()
        assert rel < 2e-2, (a, b, rel)
