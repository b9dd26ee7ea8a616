"""FP8 block-wise experts in the fused MoE (DeepSeek-V3/R1's format): ``fused_moe_fp8_block_ref``
against an independent per-token computation on dequantized experts and quantize-dequantized
activations (float64), and the Triton path (``fused_moe`` with scales) against the reference.

On the CPU the Triton path runs in the interpreter, where the grouped GEMM widens its fp8 tiles to
float32 before ``tl.dot`` (exact for e4m3): those tests check the sorting, the addressing, the
masks and where each scale is applied. The ``gpu`` tests run the native fp8 dot at DeepSeek-V3
sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest
import torch.nn.functional as F

pytest.importorskip("triton")

from deepbatch.kernels.fp8_quant import (
    dequantize_fp8_blocks_ref,
    per_token_group_quant_fp8_ref,
)
from deepbatch.kernels.fused_moe import fused_moe, fused_moe_fp8_block_ref

E4M3 = torch.float8_e4m3fn
# Relative to the output's largest magnitude. The interpreter's dot is exact on e4m3 products and
# sums in float32 like the reference; a GPU's fp8 tensor cores may add with less precision inside
# a K step, and an intermediate that then rounds across an e4m3 step moves the output a little.
REF_TOL = {torch.float32: 1e-4, torch.float16: 2e-3}
TRITON_TOL = {torch.float32: 1e-5 if INTERPRET else 1e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def cdiv(a, b):
    return -(-a // b)


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, block=(128, 128), seed=0,
                device=DEVICE, skewed=False):
    """Activations whose magnitude changes by token and ``bk`` group, and e4m3 experts whose block
    scales span a decade: a scale read from the wrong row, block or expert shows in the output."""
    bn, bk = block
    g = torch.Generator(device).manual_seed(seed)  # made where used: DeepSeek-V3's experts are GBs
    group_mag = (torch.rand(num_tokens, cdiv(hidden, bk), generator=g, device=device) * 4.6 - 2.3).exp()
    x = torch.randn(num_tokens, hidden, generator=g, device=device) * group_mag.repeat_interleave(bk, 1)[:, :hidden]

    def experts(rows, cols):
        w_q = (torch.randn(num_experts, rows, cols, generator=g, device=device) * 100).clamp(-448, 448).to(E4M3)
        spread = (torch.rand(num_experts, cdiv(rows, bn), cdiv(cols, bk), generator=g, device=device) * 2.3 - 1.15).exp()
        return w_q, spread / (100 * cols**0.5)

    w13, w13_scale = experts(2 * inter, hidden)
    w2, w2_scale = experts(hidden, inter)
    rows = []
    for _ in range(num_tokens):
        if skewed:  # every token on expert 0, the rest spread: one long run and empty experts
            rest = 1 + torch.randperm(num_experts - 1, generator=g, device=device)[: top_k - 1]
            rows.append(torch.cat((torch.zeros(1, dtype=torch.long, device=device), rest)))
        else:
            rows.append(torch.randperm(num_experts, generator=g, device=device)[:top_k])
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long, device=device)
    weights = torch.rand(num_tokens, top_k, generator=g, device=device)
    return x.to(dtype), w13, w2, w13_scale, w2_scale, weights, ids


def quant_dequant(a, bk):
    a_q, a_s = per_token_group_quant_fp8_ref(a, bk)
    return a_q.double() * a_s.double().repeat_interleave(bk, 1)[:, : a.shape[1]]


def independent_moe(x, w13, w2, w13_scale, w2_scale, weights, ids, block, quantize_act=True):
    """Token by token in float64 on whole dequantized experts; the intermediate is rounded to x's
    dtype before the activation, as the reference documents."""
    bk = block[1]
    inter = w2.shape[2]
    w13_f = [dequantize_fp8_blocks_ref(w13[e], w13_scale[e], block).double() for e in range(w13.shape[0])]
    w2_f = [dequantize_fp8_blocks_ref(w2[e], w2_scale[e], block).double() for e in range(w2.shape[0])]
    x_f = quant_dequant(x, bk) if quantize_act else x.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = (w13_f[e] @ x_f[t]).to(x.dtype)
            act = (F.silu(h[:inter]) * h[inter:])[None]
            act_f = quant_dequant(act, bk)[0] if quantize_act else act[0].double()
            out[t] += float(weights[t, k]) * (w2_f[e] @ act_f)
    return out


def assert_close_scaled(out, ref, tol):
    ref = ref.float()
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block,hidden,inter", [((128, 128), 256, 128), ((128, 128), 320, 128), ((64, 48), 256, 128)],
                         ids=["aligned", "partial-last-block", "small-blocks"])
def test_reference_matches_independent_computation(dtype, block, hidden, inter):
    """Equal but for float32 vs float64 sums and the final rounding to ``dtype``; leaving the
    activations unquantized misses by about 3% of the output's scale, far outside the tolerance."""
    args = make_inputs(9, 4, 2, hidden, inter, dtype, block, device="cpu")
    ref = fused_moe_fp8_block_ref(*args, block_size=block)
    assert ref.shape == args[0].shape and ref.dtype == dtype
    assert_close_scaled(ref, independent_moe(*args, block), REF_TOL[dtype])
    unquantized = independent_moe(*args, block, quantize_act=False).float()
    assert (ref.float() - unquantized).abs().max() > 10 * REF_TOL[dtype] * unquantized.abs().max()


@pytest.fixture
def nan_buffers(monkeypatch):
    """Buffers the wrappers allocate start as NaN: a row or scale no program writes shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_triton_matches_reference(num_tokens, dtype, nan_buffers):
    """E=8, top 2: one token leaves six experts empty; 33 tokens need several tiles per expert."""
    args = make_inputs(num_tokens, 8, 2, 256, 128, dtype, seed=num_tokens)
    x, w13, w2, w13_scale, w2_scale, weights, ids = args
    out = fused_moe(x, w13, w2, weights, ids, w13_scale, w2_scale, (128, 128))
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_scaled(out, fused_moe_fp8_block_ref(*args, block_size=(128, 128)), TRITON_TOL[dtype])


@pytest.mark.parametrize(
    "num_experts,hidden,inter,block,skewed",
    [(4, 256, 256, (128, 128), False), (8, 320, 128, (128, 128), False), (6, 256, 128, (64, 48), False),
     (8, 256, 128, (128, 128), True)],
    ids=["I256-e4", "partial-last-block", "small-blocks", "skewed-int32-ids"],
)
def test_triton_block_layouts(num_experts, hidden, inter, block, skewed, nan_buffers):
    """``bn`` smaller than the 128-wide tile (two scale rows per tile), ``bk = 48`` (three K steps
    per scale group, a 16-wide last group), a partial last block of H in both GEMMs, and one
    expert holding every token while others hold none."""
    args = make_inputs(5 if not skewed else 20, num_experts, 2, hidden, inter, torch.float32, block,
                       seed=7, skewed=skewed)
    x, w13, w2, w13_scale, w2_scale, weights, ids = args
    out = fused_moe(x, w13, w2, weights, ids.int() if skewed else ids, w13_scale, w2_scale, block)
    assert_close_scaled(out, fused_moe_fp8_block_ref(*args, block_size=block), TRITON_TOL[torch.float32])


def test_no_tokens():
    x, w13, w2, w13_scale, w2_scale, weights, ids = make_inputs(0, 4, 2, 256, 128, torch.float32)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale, w2_scale, (128, 128))
    assert out.shape == (0, 256)
    assert fused_moe_fp8_block_ref(x, w13, w2, w13_scale, w2_scale, weights, ids).shape == (0, 256)


BAD_CASES = ["bf16-weights", "fp8-x", "w13-scale-shape", "w2-scale-shape", "scales-swapped", "scale-fp16",
             "scale-not-tensor", "inter-not-multiple-of-bn", "block-size-one-int", "block-size-zero"]


def bad_call(case):
    """A call with one thing wrong: ``(x, w13, w2, w13_scale, w2_scale, weights, ids, block)``."""
    x, w13, w2, w13_scale, w2_scale, weights, ids = make_inputs(3, 4, 2, 256, 128, torch.float32, device="cpu")
    block = (128, 128)
    if case == "bf16-weights":
        w13 = w13.to(torch.bfloat16)
    elif case == "fp8-x":
        x = x.to(E4M3)
    elif case == "w13-scale-shape":
        w13_scale = w13_scale[:, :1]
    elif case == "w2-scale-shape":
        w2_scale = torch.cat((w2_scale, w2_scale), 2)
    elif case == "scales-swapped":
        w13_scale, w2_scale = w2_scale, w13_scale
    elif case == "scale-fp16":
        w2_scale = w2_scale.half()
    elif case == "scale-not-tensor":
        w2_scale = w2_scale.tolist()
    elif case == "inter-not-multiple-of-bn":  # I = 96: a 128-row scale block would span gate and up rows
        w13, w2 = w13[:, :192], w2[:, :, :96]
        w13_scale, w2_scale = w13_scale[:, :2], w2_scale[:, :, :1]
    elif case == "block-size-one-int":
        block = 128
    elif case == "block-size-zero":
        block = (0, 128)
    return [t.to(DEVICE) if torch.is_tensor(t) else t for t in (x, w13, w2, w13_scale, w2_scale, weights, ids)] + [block]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise_value_error(case):
    x, w13, w2, w13_scale, w2_scale, weights, ids, block = bad_call(case)
    with pytest.raises(ValueError):
        fused_moe(x, w13, w2, weights, ids, w13_scale, w2_scale, block)
    with pytest.raises(ValueError):
        fused_moe_fp8_block_ref(x, w13, w2, w13_scale, w2_scale, weights, ids, block)


@pytest.mark.parametrize("case", ["scales-without-block", "fp8-weights-without-scales", "bk-not-multiple-of-16"])
def test_triton_only_bad_inputs(case):
    x, w13, w2, w13_scale, w2_scale, weights, ids = make_inputs(3, 4, 2, 256, 128, torch.float32)
    kwargs = {"w13_scale": w13_scale, "w2_scale": w2_scale, "block_size": (128, 128)}
    if case == "scales-without-block":
        del kwargs["block_size"]
    elif case == "fp8-weights-without-scales":
        kwargs = {}
    else:  # the reference takes any bk; the kernel's dot needs K steps of 16
        kwargs = {"w13_scale": w13_scale.repeat_interleave(2, 2), "w2_scale": w2_scale.repeat_interleave(2, 2),
                  "block_size": (128, 72)}
        ref = fused_moe_fp8_block_ref(x, w13, w2, kwargs["w13_scale"], kwargs["w2_scale"], weights, ids, (128, 72))
        assert ref.shape == x.shape
    with pytest.raises(ValueError, match="w13_scale|block|fp8"):
        fused_moe(x, w13, w2, weights, ids, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens,num_experts,inter", [(1, 64, 2048), (64, 32, 2048), (2048, 16, 2048),
                                                          (512, 64, 256)],
                         ids=["decode-e64", "t64-e32", "prefill-e16", "tp8-shard-e64"])
def test_gpu_bf16_deepseek_v3_dims(num_tokens, num_experts, inter):
    """DeepSeek-V3's experts (H 7168, I 2048, or its 256-wide share under 8-way TP), top 8."""
    args = make_inputs(num_tokens, num_experts, 8, 7168, inter, torch.bfloat16, seed=3)
    x, w13, w2, w13_scale, w2_scale, weights, ids = args
    out = fused_moe(x, w13, w2, weights, ids, w13_scale, w2_scale, (128, 128)).float()
    ref = fused_moe_fp8_block_ref(*args).float()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 1e-2, rel
    assert_close_scaled(out, ref, TRITON_TOL[torch.bfloat16])
