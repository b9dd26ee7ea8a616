"""The Triton rotary embedding held to ``rotary_ref`` (transformers' ``rotate_half`` arithmetic), on
the CPU through the Triton interpreter."""

import os

import torch

# The interpreter on the CPU; compiled kernels on CUDA tensors wherever a GPU is present (the
# interpreter's bf16 rounding is not faithful, so the bf16 test needs a GPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.rotary import rotary, rotary_ref  # noqa: E402

# Against the reference in float32 rounded once, which is what the kernel computes: one ulp apart
# at most (a GPU may fuse the multiply-adds).
ULP = {torch.float32: dict(atol=1e-5, rtol=1e-6), torch.float16: dict(atol=1e-5, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-5, rtol=8e-3)}


def rounding_bound(x, rot):
    """How far the reference in x's dtype may stray: it rounds the tables, both products and the
    sum, each within eps/2 of ``|x1| + |x2|`` (|cos|, |sin| <= 1), the kernel its one result."""
    a = x[..., :rot].float().abs()
    pair = a[..., : rot // 2] + a[..., rot // 2 :]
    return 3 * torch.finfo(x.dtype).eps * torch.cat((pair, pair), dim=-1) + 1e-6


def tables(num_tokens, rot, device=DEVICE):
    """Half tables of real rope angles at scattered positions (float32, as RotaryEmbedding keeps them)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    positions = torch.randint(0, 4096, (num_tokens,)).float()
    freqs = torch.outer(positions, inv_freq).to(device)
    return freqs.cos(), freqs.sin()


def fused_qkv(num_tokens, hq, hk, head_dim, dtype, device=DEVICE):
    """q and k as strided views of one ``[q | k | v]`` projection row, as the attention layers pass them."""
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, dtype=dtype, device=device) * 3
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    return qkv, q.view(num_tokens, hq, head_dim), k.view(num_tokens, hk, head_dim)


def check(q, k, cos, sin, rot):
    bounds = rounding_bound(q, rot), rounding_bound(k, rot)
    ref = rotary_ref(q, k, cos, sin, rot)
    ref32 = rotary_ref(q.float(), k.float(), cos, sin, rot)
    got = rotary(q, k, cos, sin, rot)
    assert got[0] is q and got[1] is k  # in place
    for g, r, r32, bound in zip(got, ref, ref32, bounds):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r32.to(g.dtype), **ULP[g.dtype])
        assert ((g[..., :rot].float() - r[..., :rot].float()).abs() <= bound).all()
        # Dims past rotary_dim are not touched.
        assert torch.equal(g[..., rot:], r[..., rot:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa8-2", "mha4"])
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (128, 128), (64, 32)], ids=["d64", "d128", "d64-rot32"])
def test_matches_reference(dtype, num_tokens, heads, head_dim, rot):
    torch.manual_seed(0)
    qkv, q, k = fused_qkv(num_tokens, *heads, head_dim, dtype)
    v0 = qkv[:, (heads[0] + heads[1]) * head_dim :].clone()
    check(q, k, *tables(num_tokens, rot), rot)
    assert torch.equal(qkv[:, (heads[0] + heads[1]) * head_dim :], v0)  # v, beside them, untouched


def test_fp32_bit_exact_in_the_interpreter():
    # The interpreter does not fuse multiply-adds: a*c - b*s is the reference's a*c + (-b)*s.
    if not INTERPRET:
        pytest.skip("a GPU may fuse multiply-adds")
    torch.manual_seed(1)
    _, q, k = fused_qkv(5, 4, 2, 64, torch.float32)
    cos, sin = tables(5, 64)
    ref = rotary_ref(q, k, cos, sin, 64)
    got = rotary(q, k, cos, sin, 64)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_strided_heads_and_many_heads():
    torch.manual_seed(2)
    # MLA's q_pe: the last P dims of each [nope | pe] head (head stride > P); k_pe one shared head.
    q = torch.randn(6, 40, 96, device=DEVICE)[:, :, 32:]
    k = torch.randn(6, 96, device=DEVICE)[:, 32:].unsqueeze(1)
    check(q, k, *tables(6, 64), 64)
    # More heads than one block of the kernel holds (it loops over head blocks).
    _, q, k = fused_qkv(3, 80, 8, 128, torch.float32)
    check(q, k, *tables(3, 128), 128)


def test_rotary_embedding_tables():
    """The kernel on RotaryEmbedding's own tables (llama3 scaling) agrees with its torch path."""
    from transformers import LlamaConfig

    from deepbatch.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 128})
    rope = RotaryEmbedding(config, 64, 512).to(DEVICE)
    at = rope.at(torch.tensor([0, 5, 130, 511], device=DEVICE))
    torch.manual_seed(3)
    _, q, k = fused_qkv(4, 4, 2, 64, torch.float32)
    ref_q, ref_k = at(q, k) if DEVICE == "cpu" else rotary_ref(q, k, at.cos, at.sin, 64)
    got_q, got_k = rotary(q, k, at.cos, at.sin, 64)
    torch.testing.assert_close(got_q, ref_q, **ULP[torch.float32])
    torch.testing.assert_close(got_k, ref_k, **ULP[torch.float32])


def test_no_tokens():
    q, k = torch.empty(0, 4, 64, device=DEVICE), torch.empty(0, 2, 64, device=DEVICE)
    got = rotary(q, k, *tables(0, 64), 64)
    assert got[0].shape == q.shape and got[1].shape == k.shape


@pytest.mark.parametrize("case", ["q-rank", "int-dtype", "k-dtype", "k-tokens", "rot-odd", "rot-too-big",
                                  "cos-shape", "cos-full-layout", "strided-last-dim"])
def test_bad_inputs_raise_value_error(case):
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    (cos, sin), rot = tables(4, 64, "cpu"), 64
    if case == "q-rank":
        q = q.view(4, 256)
    elif case == "int-dtype":
        q, k = q.int(), k.int()
    elif case == "k-dtype":
        k = k.half()
    elif case == "k-tokens":
        k = k[:3]
    elif case == "rot-odd":
        rot = 63
    elif case == "rot-too-big":
        rot = 128
    elif case == "cos-shape":
        cos = cos[:, :16]
    elif case == "cos-full-layout":
        cos = torch.cat((cos, cos), -1).unsqueeze(1)
    elif case == "strided-last-dim":
        q = torch.randn(4, 64, 4).transpose(1, 2)
    with pytest.raises(ValueError):
        rotary(q, k, cos, sin, rot)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim,rot", [(128, 128), (64, 32)], ids=["d128", "d64-rot32"])
def test_gpu_bf16_large(head_dim, rot):
    torch.manual_seed(4)
    _, q, k = fused_qkv(2000, 28, 4, head_dim, torch.bfloat16, device="cuda")
    check(q, k, *tables(2000, rot, device="cuda"), rot)


# -- per-head RMSNorm fused in front of the rotation (Qwen3's q_norm / k_norm) ---------------------


def norm_then_rotate(q, k, wq, wk, cos, sin, eps):
    from deepbatch.kernels.rms_norm import rms_norm_ref

    return rotary_ref(rms_norm_ref(q, wq, eps), rms_norm_ref(k, wk, eps), cos, sin, q.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (16, 8)], ids=["gqa8-2", "qwen3-16-8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_head_norm_matches_norm_then_rotate(dtype, heads, head_dim):
    torch.manual_seed(5)
    qkv, q, k = fused_qkv(9, *heads, head_dim, dtype)
    v0 = qkv[:, (heads[0] + heads[1]) * head_dim :].clone()
    wq = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    wk = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    cos, sin = tables(9, head_dim)
    ref = norm_then_rotate(q.clone(), k.clone(), wq, wk, cos, sin, 1e-6)
    ref32 = norm_then_rotate(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-6)
    got = rotary(q, k, cos, sin, head_dim, wq, wk, 1e-6)
    assert got[0] is q and got[1] is k
    for g, r, r32 in zip(got, ref, ref32):
        # The normalised head is unit-RMS times ~1: fp32 within an ulp; fp16 within the rounding of
        # the norm's output (one ulp of values up to ~4) plus the rotation's.
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=4e-3)
        torch.testing.assert_close(g.float(), r.float(), **tol)
        torch.testing.assert_close(g.float(), r32, **tol)
        # Not the plain rotation: the norm did run (inputs have RMS ~3).
        assert (g.float().pow(2).mean(-1).sqrt() < 3).all()
    assert torch.equal(qkv[:, (heads[0] + heads[1]) * head_dim :], v0)


def test_rotary_at_applies_qwen3_head_norms():
    """``RotaryAt(q, k, q_norm, k_norm)``: the torch path (CPU) and the fused kernel agree."""
    from transformers import Qwen3Config

    from deepbatch.layers.norm import RMSNorm
    from deepbatch.layers.rotary import RotaryEmbedding

    config = Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    rope = RotaryEmbedding(config, 64, 512)
    torch.manual_seed(6)
    q_norm, k_norm = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    positions = torch.tensor([0, 7, 300])
    _, q, k = fused_qkv(3, 4, 2, 64, torch.float32, device="cpu")
    ref_q, ref_k = rope.at(positions)(q.clone(), k.clone(), q_norm, k_norm)  # CPU: modules, then torch rotation
    exp_q, exp_k = norm_then_rotate(q, k, q_norm.weight, k_norm.weight, *(t[positions] for t in (rope.cos, rope.sin)),
                                    1e-6)
    torch.testing.assert_close(ref_q, exp_q, **ULP[torch.float32])
    torch.testing.assert_close(ref_k, exp_k, **ULP[torch.float32])
    at = rope.at(positions.to(DEVICE)) if DEVICE != "cpu" else rope.at(positions)
    got_q, got_k = rotary(q.to(DEVICE), k.to(DEVICE), at.cos.to(DEVICE), at.sin.to(DEVICE), 64,
                          q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE), q_norm.eps)
    torch.testing.assert_close(got_q.cpu(), exp_q, **ULP[torch.float32])
    torch.testing.assert_close(got_k.cpu(), exp_k, **ULP[torch.float32])


@pytest.mark.parametrize("case", ["one-weight", "partial-rotary", "weight-shape"])
def test_fused_head_norm_bad_inputs(case):
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    (cos, sin), rot = tables(4, 64, "cpu"), 64
    wq, wk = torch.ones(64), torch.ones(64)
    if case == "one-weight":
        wk = None
    elif case == "partial-rotary":
        (cos, sin), rot = tables(4, 32, "cpu"), 32
    elif case == "weight-shape":
        wq = torch.ones(32)
    with pytest.raises(ValueError):
        rotary(q, k, cos, sin, rot, wq, wk)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_fused_head_norm():
    torch.manual_seed(7)
    _, q, k = fused_qkv(2000, 16, 8, 128, torch.bfloat16, device="cuda")
    wq = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    wk = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    cos, sin = tables(2000, 128, device="cuda")
    ref32 = norm_then_rotate(q.float(), k.float(), wq.float(), wk.float(), cos, sin, 1e-6)
    got = rotary(q, k, cos, sin, 128, wq, wk, 1e-6)
    for g, r32 in zip(got, ref32):
        torch.testing.assert_close(g.float(), r32, atol=3e-2, rtol=2e-2)
