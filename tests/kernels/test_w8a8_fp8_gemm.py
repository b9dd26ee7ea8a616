"""W8A8 FP8 GEMMs (``kernels/w8a8_fp8_gemm.py``): the block-wise and per-channel torch references
against a matmul of both operands dequantized independently (float64), and the Triton kernels
against the references.

Runs on the CPU through the Triton interpreter, where the kernels widen the fp8 tiles to float32
before ``tl.dot`` (exact for e4m3 values): these tests check the addressing, the masks and where
each scale is applied. The ``gpu`` tests run the native fp8 ``tl.dot`` against the same
references at DeepSeek-V3 sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels import fp8_scaled_mm, w8a8_fp8_gemm  # noqa: E402
from deepbatch.kernels.fp8_quant import (  # noqa: E402
    dequantize_fp8_blocks_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
)
from deepbatch.kernels.w8a8_fp8_gemm import (  # noqa: E402
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_ref,
    w8a8_channel_fp8_matmul,
    w8a8_channel_fp8_matmul_ref,
)

E4M3 = torch.float8_e4m3fn
OUT_TOL = {torch.float32: dict(rtol=1e-5), torch.float16: dict(rtol=2e-3), torch.bfloat16: dict(rtol=1.6e-2)}


def random_fp8(rows, cols, gen):
    return (torch.randn(rows, cols, generator=gen) * 100).clamp(-448, 448).to(E4M3)


def random_scales(shape, gen):
    """Scales spread over three decades, so one read from the wrong row, column or block shows."""
    return (torch.rand(shape, generator=gen) * 6.9 - 9.0).exp()


def block_operands(m, n, k, bn, bk, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m).view(m, 1)
    x_q, x_s = per_token_group_quant_fp8_ref(x, bk)
    w_q = random_fp8(n, k, g)
    w_s = random_scales((-(-n // bn), -(-k // bk)), g)
    return [t.to(device) for t in (x_q, x_s, w_q, w_s)]


def channel_operands(m, n, k, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m).view(m, 1)
    x_q, x_s = per_token_group_quant_fp8_ref(x, max(k, 1))
    w_q = random_fp8(n, k, g)
    w_s = random_scales((n, 1), g)
    bias = torch.randn(n, generator=g) * 1e-3
    return [t.to(device) for t in (x_q, x_s, w_q, w_s, bias)]


def assert_matches(got, want, out_dtype):
    """Elementwise within the output dtype's rounding, relative to the largest output: products
    are exact, so the kernel and the reference differ only by float32 summation order."""
    assert got.dtype == out_dtype and got.shape == want.shape
    got, want = got.float().cpu(), want.float().cpu()
    scale = want.abs().max().item() or 1.0
    torch.testing.assert_close(got, want, atol=OUT_TOL[out_dtype]["rtol"] * scale, **OUT_TOL[out_dtype])


# -- the references against dequantize-then-matmul ------------------------------------------------


@pytest.mark.parametrize("m, n, k, bn, bk", [(5, 256, 384, 128, 128), (3, 200, 300, 128, 128),
                                             (4, 50, 70, 24, 16)], ids=str)
def test_block_reference_is_a_matmul_of_dequantized_operands(m, n, k, bn, bk):
    x_q, x_s, w_q, w_s = block_operands(m, n, k, bn, bk, device="cpu")
    x = x_q.double() * x_s.double().repeat_interleave(bk, 1)[:, :k]
    w = dequantize_fp8_blocks_ref(w_q, w_s, (bn, bk)).double()
    want = x @ w.T
    got = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (bn, bk), torch.float32)
    # float32 sums of at most 384 exact products: well inside 1e-5 of the largest output.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("scales", ["per-channel", "per-channel-1d", "per-tensor"])
def test_channel_reference_is_a_matmul_of_dequantized_operands(scales):
    x_q, x_s, w_q, w_s, bias = channel_operands(6, 200, 300, device="cpu")
    if scales == "per-channel-1d":
        w_s = w_s.view(-1)
    elif scales == "per-tensor":
        x_s, w_s = x_s[:1, 0], w_s[:1, 0]
    x = x_q.double() * x_s.double().reshape(-1, 1)
    w = w_q.double() * w_s.double().reshape(-1, 1)
    want = x @ w.T + bias.double()
    got = w8a8_channel_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_fp8_path_approximates_the_float_linear():
    # End to end on a real weight: quantized per 128 x 128 block (the checkpoint keeps the
    # dequantization factor, which multiplies) and activations quantized per group by the kernel.
    g = torch.Generator().manual_seed(9)
    n, k, bn, bk = 256, 384, 128, 128
    x = torch.randn(7, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    w_blocks = w.view(n // bn, bn, k // bk, bk)
    scale_inv = w_blocks.abs().amax((1, 3)) / 448.0
    w_q = (w_blocks / scale_inv[:, None, :, None]).view(n, k).clamp(-448, 448).to(E4M3)
    x_q, x_s = per_token_group_quant_fp8(x.to(DEVICE), bk)
    out = w8a8_block_fp8_matmul(x_q, x_s, w_q.to(DEVICE), scale_inv.to(DEVICE), (bn, bk), torch.float32).cpu()
    want = x @ w.T
    # Two 3-bit mantissas: a few percent of error in the norm, nowhere near a misplaced scale.
    assert (out - want).norm() / want.norm() < 0.05


# -- the kernels against the references -----------------------------------------------------------

# M covers every launch config; N and K leave partial tiles and partial scale blocks; bn = 48 is no
# multiple of any BLOCK_N; bk = 96 takes K steps of 32.
BLOCK_CASES = [
    (1, 384, 384, 128, 128),
    (3, 200, 300, 128, 128),
    (16, 130, 257, 64, 64),
    (37, 100, 200, 48, 32),
    (70, 96, 288, 128, 96),
    (130, 64, 128, 128, 128),
]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, bn, bk", BLOCK_CASES, ids=str)
def test_block_kernel_matches_reference(m, n, k, bn, bk, out_dtype):
    x_q, x_s, w_q, w_s = block_operands(m, n, k, bn, bk, seed=m)
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (bn, bk), out_dtype)
    assert_matches(w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (bn, bk), out_dtype), want, out_dtype)


def test_block_kernel_strided_operands():
    x_q, x_s, w_q, w_s = block_operands(37, 200, 300, 64, 32, seed=1)
    wide = torch.zeros(37, 400, dtype=torch.uint8, device=DEVICE).view(E4M3)
    wide[:, 50:350] = x_q
    x_view = wide[:, 50:350]  # row stride 400
    x_s_col_major = x_s.t().contiguous().t()  # scales stored group-major
    w_s_col_major = w_s.t().contiguous().t()
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (64, 32), torch.float32)
    got = w8a8_block_fp8_matmul(x_view, x_s_col_major, w_q, w_s_col_major, (64, 32), torch.float32)
    assert_matches(got, want, torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1, 384, 384), (3, 200, 300), (37, 130, 257), (260, 300, 136)], ids=str)
def test_channel_kernel_matches_reference(m, n, k, out_dtype):
    x_q, x_s, w_q, w_s, bias = channel_operands(m, n, k, seed=m)
    for b in (None, bias, bias.to(out_dtype)):
        want = w8a8_channel_fp8_matmul_ref(x_q, x_s, w_q, w_s, out_dtype, b)
        assert_matches(w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, out_dtype, b), want, out_dtype)


@pytest.mark.parametrize("scales", ["w-1d", "per-tensor-weight", "per-tensor-both"])
def test_channel_kernel_scale_layouts(scales):
    x_q, x_s, w_q, w_s, bias = channel_operands(9, 100, 200, seed=3)
    if scales == "w-1d":
        w_s = w_s.view(-1)
    elif scales == "per-tensor-weight":
        w_s = w_s[:1, 0]
    else:
        x_s, w_s = x_s[:1], w_s[:1]
    want = w8a8_channel_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, bias)
    assert_matches(w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias), want, torch.float32)


def test_channel_kernel_strided_activations():
    x_q, x_s, w_q, w_s, _ = channel_operands(12, 100, 160, seed=4)
    wide = torch.zeros(24, 200, dtype=torch.uint8, device=DEVICE).view(E4M3)
    wide[::2, 20:180] = x_q
    x_s_strided = torch.zeros(12, 3, device=DEVICE)[:, 1:2]
    x_s_strided.copy_(x_s)
    want = w8a8_channel_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32)
    got = w8a8_channel_fp8_matmul(wide[::2, 20:180], x_s_strided, w_q, w_s, torch.float32)
    assert_matches(got, want, torch.float32)


def test_empty_batch_and_zero_activations():
    x_q, x_s, w_q, w_s = block_operands(0, 64, 128, 128, 128)
    assert w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.float16).shape == (0, 64)
    x_q, x_s, w_q, w_s, bias = channel_operands(0, 64, 128)
    assert w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.float16, bias).shape == (0, 64)
    # An all-zero token (scale floor) gives zeros, or the bias.
    x_q, x_s = per_token_group_quant_fp8(torch.zeros(2, 128, device=DEVICE), 128)
    w_q, w_s, bias = w_q[:, :128], w_s, bias
    assert (w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32) == 0).all()
    assert torch.equal(w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias).cpu(),
                       bias.cpu().expand(2, -1))


@pytest.mark.skipif(not INTERPRET, reason="the GPU runs the native dot in every test")
def test_native_fp8_dot_where_the_interpreter_has_one(monkeypatch):
    # The fp8 tiles straight into tl.dot, as on a GPU: checks that the kernels' native path
    # type-checks and indexes as the widened one does, when this Triton's interpreter multiplies
    # fp8 values (an all-ones product tells it from one that multiplies the raw bytes).
    monkeypatch.setattr(w8a8_fp8_gemm, "_upcast_dot", lambda device: False)
    ones = torch.ones(16, 128).to(E4M3)
    probe = w8a8_channel_fp8_matmul(ones, torch.ones(16, 1), ones, torch.ones(16), torch.float32)
    if not (probe == 128).all():
        pytest.skip("this Triton's interpreter does not multiply fp8 operands by value")
    x_q, x_s, w_q, w_s = block_operands(37, 200, 300, 48, 32, seed=5)
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (48, 32), torch.float32)
    assert_matches(w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (48, 32), torch.float32), want, torch.float32)
    x_q, x_s, w_q, w_s, bias = channel_operands(37, 200, 300, seed=5)
    want = w8a8_channel_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, bias)
    assert_matches(w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias), want, torch.float32)


# -- bad inputs -----------------------------------------------------------------------------------


def _block_call(fn, case):
    x_q, x_s, w_q, w_s = block_operands(4, 64, 256, 32, 128)
    block, out_dtype = (32, 128), torch.bfloat16
    if case == "mismatched-k":
        w_q = w_q[:, :128].contiguous()
    elif case == "x-scale-shape":
        x_s = x_s[:, :1]
    elif case == "w-scale-shape":
        w_s = w_s[:1]
    elif case == "x-dtype":
        x_q = x_q.float()
    elif case == "x-1d":
        x_q = x_q[0]
    elif case == "scale-dtype":
        w_s = w_s.half()
    elif case == "out-dtype":
        out_dtype = torch.int32
    elif case == "block":
        block = (32,)
    elif case == "bk-not-32":
        x_q, x_s, w_q, w_s = block_operands(4, 64, 256, 32, 16)
        block = (32, 16)
    elif case == "strided-last-dim":
        x_q = x_q.t().contiguous().t()
    return fn(x_q, x_s, w_q, w_s, block, out_dtype)


BAD_BLOCK = {
    "mismatched-k": "disagree on K", "x-scale-shape": "x_s must be float32 of shape", "w-scale-shape": "w_s must be",
    "x-dtype": "x_q must be a 2-D", "x-1d": "x_q must be a 2-D", "scale-dtype": "w_s must be float32",
    "out-dtype": "out_dtype", "block": "block size", "bk-not-32": "multiple of 32", "strided-last-dim": "contiguous",
}


@pytest.mark.parametrize("case", list(BAD_BLOCK))
def test_block_bad_inputs_raise_value_error(case):
    with pytest.raises(ValueError, match=BAD_BLOCK[case]):
        _block_call(w8a8_block_fp8_matmul, case)
    if case not in ("bk-not-32", "strided-last-dim"):  # the reference takes both
        with pytest.raises(ValueError, match=BAD_BLOCK[case]):
            _block_call(w8a8_block_fp8_matmul_ref, case)


BAD_CHANNEL = {
    "mismatched-k": "disagree on K", "x-scale-shape": "x_s must be float32 of shape",
    "w-scale-shape": "w_s must be float32 of shape", "w-dtype": "w_q must be a 2-D",
    "scale-dtype": "x_s must be float32", "bias-shape": "bias must be", "bias-dtype": "bias must be", "out-dtype": "out_dtype",
}


@pytest.mark.parametrize("case", list(BAD_CHANNEL))
def test_channel_bad_inputs_raise_value_error(case):
    x_q, x_s, w_q, w_s, bias = channel_operands(4, 64, 128)
    out_dtype = torch.float16
    if case == "mismatched-k":
        x_q = x_q[:, :64].contiguous()
    elif case == "x-scale-shape":
        x_s = x_s[:2]
    elif case == "w-scale-shape":
        w_s = w_s[:32]
    elif case == "w-dtype":
        w_q = w_q.view(torch.int8)
    elif case == "scale-dtype":
        x_s = x_s.double()
    elif case == "bias-shape":
        bias = bias[:10]
    elif case == "bias-dtype":
        bias = bias.to(torch.int32)
    else:
        out_dtype = "float16"
    for fn in (w8a8_channel_fp8_matmul, w8a8_channel_fp8_matmul_ref):
        with pytest.raises(ValueError, match=BAD_CHANNEL[case]):
            fn(x_q, x_s, w_q, w_s, out_dtype, bias)


@pytest.mark.parametrize("table", ["_BLOCK_CONFIGS", "_CHANNEL_CONFIGS"])
def test_config_tables_cover_every_batch_size(table):
    table = getattr(w8a8_fp8_gemm, table)
    assert table[-1][0] is None
    sizes = [w8a8_fp8_gemm._config(table, m)[0] for m in (1, 16, 17, 64, 65, 256, 257, 100000)]
    assert sizes == sorted(sizes) and all(s >= 16 for s in sizes)


# -- GPU ------------------------------------------------------------------------------------------

# The tensor cores' fp8 accumulator keeps fewer bits than float32 within one K step; a scale read
# from the wrong place is off by orders of magnitude more.
FP8_MMA_REL_ERR = 1e-3
GPU_SHAPES = [(4096, 7168), (7168, 2048), (2112, 7168), (576, 7168)]  # DeepSeek-V3 projections (N, K)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 37, 64, 200, 512])
@pytest.mark.parametrize("n, k", GPU_SHAPES, ids=str)
def test_gpu_bf16_large_block(m, n, k):
    torch.manual_seed(m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    x_q, x_s = per_token_group_quant_fp8(x, 128)
    g = torch.Generator().manual_seed(n + k)
    w_q = random_fp8(n, k, g).cuda()
    w_s = random_scales((-(-n // 128), -(-k // 128)), g).cuda()
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    got = w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.bfloat16)
    assert_matches(got, want.to(torch.bfloat16), torch.bfloat16)
    got32 = w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    assert ((got32 - want).norm() / want.norm()).item() < FP8_MMA_REL_ERR


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("m", [1, 16, 37, 64, 200, 512])
@pytest.mark.parametrize("n, k", GPU_SHAPES, ids=str)
def test_gpu_bf16_large_channel(m, n, k, backend):
    torch.manual_seed(m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    x_q, x_s = per_token_group_quant_fp8(x, k)
    g = torch.Generator().manual_seed(n + k)
    w_q = random_fp8(n, k, g).cuda()
    w_s = random_scales((n, 1), g).cuda()
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") * 1e-3
    want = w8a8_channel_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32, bias)
    got = w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.bfloat16, bias, backend=backend)
    assert_matches(got, want.to(torch.bfloat16), torch.bfloat16)
    got32 = w8a8_channel_fp8_matmul(x_q, x_s, w_q, w_s, torch.float32, bias, backend=backend)
    assert ((got32 - want).norm() / want.norm()).item() < FP8_MMA_REL_ERR


# -- the cuBLASLt block-wise path -----------------------------------------------------------------


def _round_up(x, m):
    return -(-x // m) * m


def as_cublaslt_reads(a, scale_a, w_q, scale_b, m):
    """The product computed from the buffers the way cuBLASLt reads them: from each scale tensor's
    first element, at its own fixed pitches (activation scale (m, kb) at ``kb * M4 + m``, weight
    scale (nb, kb) at ``nb * L4 + kb``), whatever strides the tensors claim."""
    m4, k = a.shape
    n, blocks = w_q.shape[0], k // 128
    pitch = _round_up(blocks, 4)
    sa = torch.as_strided(scale_a, (blocks * m4,), (1,)).view(blocks, m4).t()
    sb = torch.as_strided(scale_b, (n // 128 * pitch,), (1,)).view(n // 128, pitch)[:, :blocks]
    out = w8a8_block_fp8_matmul_ref(a, sa.contiguous(), w_q, sb.contiguous(), (128, 128), torch.float32)
    return out[:m]


# M off and on multiples of 4; K / 128 = 1, 5, 9 (not multiples of 4) and 4, 56; N over several
# 128-row blocks, so a weight scale read at the wrong pitch lands on another block's scale.
CUBLAS_LAYOUT_CASES = [(1, 256, 128), (3, 384, 640), (4, 256, 512), (37, 384, 1152), (130, 256, 7168)]


@pytest.mark.parametrize("m, n, k", CUBLAS_LAYOUT_CASES, ids=str)
def test_cublas_operands_as_cublaslt_reads_them(m, n, k):
    x_q, x_s, w_q, w_s = block_operands(m, n, k, 128, 128, seed=m + k, device="cpu")
    a, scale_a, scale_b = fp8_scaled_mm.cublas_block_operands(x_q, x_s, w_q, w_s)
    assert a.shape == (_round_up(m, 4), k) and a.is_contiguous() and (a[m:].float() == 0).all()
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    assert_matches(as_cublaslt_reads(a, scale_a, w_q, scale_b, m), want, torch.float32)


@pytest.mark.skipif(fp8_scaled_mm.scaled_mm_v2() is None, reason="this torch has no torch.nn.functional.scaled_mm")
@pytest.mark.parametrize("m, n, k", CUBLAS_LAYOUT_CASES, ids=str)
def test_cublas_operands_pass_torchs_own_layout_checks(m, n, k):
    # torch.nn.functional.scaled_mm on the meta device runs torch's checks of the DeepSeek scale
    # layouts (shapes and strides, the L4 padding) without a GPU.
    x_q, x_s, w_q, w_s = block_operands(m, n, k, 128, 128, device="meta")
    a, scale_a, scale_b = fp8_scaled_mm.cublas_block_operands(x_q, x_s, w_q, w_s)
    scaled_mm, recipe = fp8_scaled_mm.scaled_mm_v2()
    out = scaled_mm(a, w_q.t(), scale_a, recipe.BlockWise1x128, scale_b, recipe.BlockWise128x128,
                    output_dtype=torch.bfloat16)
    assert out.shape == (_round_up(m, 4), n)


@pytest.mark.parametrize("case, match", [
    ("block", "128 x 128 weight blocks"), ("n", "multiples of 128"), ("k", "multiples of 128"),
    ("out-dtype", "bfloat16 only"), ("device", "needs CUDA tensors" if INTERPRET else "SM90|torch"),
])
def test_cublas_backend_says_why_it_does_not_apply(case, match):
    m, n, k, block, out_dtype = 8, 256, 256, (128, 128), torch.bfloat16
    if case == "block":
        block = (64, 128)
    elif case == "n":
        n = 192
    elif case == "k":
        k = 320
    elif case == "out-dtype":
        out_dtype = torch.float16
    x_q, x_s, w_q, w_s = block_operands(m, n, k, *block)
    if case == "device" and w8a8_fp8_gemm.cublas_block_unsupported(x_q, w_q, block, out_dtype) is None:
        pytest.skip("cuBLASLt's block-wise GEMM applies on this machine")
    with pytest.raises(ValueError, match=f"backend 'cublas' .*({match})"):
        w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, block, out_dtype, backend="cublas")


def test_block_backend_name_is_checked():
    x_q, x_s, w_q, w_s = block_operands(4, 128, 128, 128, 128)
    with pytest.raises(ValueError, match="backend must be"):
        w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.float32, backend="cutlass")


def test_auto_backend_follows_the_switch(monkeypatch):
    taken = []

    def cublas_spy(x_q, x_s, w_q, w_s, out_dtype):
        taken.append("cublas")
        return w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (128, 128), out_dtype)

    monkeypatch.setattr(w8a8_fp8_gemm, "cublas_block_fp8_matmul", cublas_spy)
    monkeypatch.setattr(w8a8_fp8_gemm, "cublas_block_unsupported", lambda *args: None)
    x_q, x_s, w_q, w_s = block_operands(5, 256, 256, 128, 128)
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    assert w8a8_fp8_gemm.BLOCK_AUTO_BACKEND == "triton"
    assert_matches(w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.float32), want, torch.float32)
    assert taken == []
    monkeypatch.setattr(w8a8_fp8_gemm, "BLOCK_AUTO_BACKEND", "cublas")
    w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    assert taken == ["cublas"]
    # Where cuBLASLt does not apply, "auto" falls back to the Triton kernel instead of refusing.
    monkeypatch.setattr(w8a8_fp8_gemm, "cublas_block_unsupported", lambda *args: "does not apply")
    got = w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    assert taken == ["cublas"]
    assert_matches(got, want, torch.float32)


# bf16 output rounding (2^-9 relative) dominates; a scale from the wrong block is off by far more.
CUBLAS_REL_ERR = 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 3, 16, 37, 130, 512, 1027])
@pytest.mark.parametrize("n, k", [(4096, 7168), (7168, 2048), (2048, 512), (384, 1152), (256, 640)], ids=str)
def test_gpu_cublas_block_matches_reference(m, n, k):
    torch.manual_seed(m)
    x_q, x_s = per_token_group_quant_fp8(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), 128)
    g = torch.Generator().manual_seed(n + k)
    w_q = random_fp8(n, k, g).cuda()
    w_s = random_scales((n // 128, k // 128), g).cuda()
    reason = w8a8_fp8_gemm.cublas_block_unsupported(x_q, w_q, (128, 128), torch.bfloat16)
    if reason is not None:
        pytest.skip(f"cuBLASLt {reason}")
    want = w8a8_block_fp8_matmul_ref(x_q, x_s, w_q, w_s, (128, 128), torch.float32)
    got = w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, (128, 128), torch.bfloat16, backend="cublas")
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert_matches(got, want.to(torch.bfloat16), torch.bfloat16)
    assert ((got.float() - want).norm() / want.norm()).item() < CUBLAS_REL_ERR
    # Row-major activation scales (as the quantization kernel writes them) and column-major ones
    # already in cuBLASLt's layout give the same product.
    again = w8a8_block_fp8_matmul(x_q, x_s.t().contiguous().t(), w_q, w_s, (128, 128), torch.bfloat16,
                                  backend="cublas")
    assert torch.equal(got, again)
