"""The W4A16 layout helpers held to hand-worked bit patterns and an element-by-element loop, and
the Triton GEMM (one pass and split-K) held to ``w4a16_matmul_ref``. Runs on the CPU through the
Triton interpreter."""

import os

import torch

# The interpreter on the CPU; compiled kernels on CUDA tensors wherever a GPU is present (the
# interpreter's bf16 dot and bf16 rounding are not faithful, so the bf16 tests need a GPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import subprocess
import sys

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.w4a16_gemm import (
    dequantize_int4_ref,
    pack_int4,
    unpack_int4,
    w4a16_config,
    w4a16_matmul,
    w4a16_matmul_ref,
)

TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 1e-2, "rtol": 1e-2}}


@pytest.fixture
def nan_buffers(monkeypatch):
    """Float buffers the wrapper allocates start as NaN: an output or partial no program writes
    shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def make_weights(n, k, group_size, dtype, device=DEVICE, symmetric=False):
    """Random codes, positive scales sized so that ``y`` stays O(1), integer or fractional zeros."""
    q = torch.randint(0, 16, (k, n), dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n) + 0.5) * (2.0 / k**0.5) / 8
    if symmetric:
        zeros = torch.full((groups, n), 8.0)
    else:
        zeros = torch.randint(0, 16, (groups, n)).float() + torch.rand(groups, n).round() * 0.5
    return q, pack_int4(q).to(device), scales.to(dtype).to(device), zeros.to(dtype).to(device)


# --- layout helpers -----------------------------------------------------------------------------


def test_pack_int4_bit_pattern():
    # Column 0 holds k = 0..7 -> nibbles 0..7, lowest first: 0x76543210. Column 1 holds 8..15:
    # 0xFEDCBA98 has bit 31 set, so it reads back as a negative int32.
    q = torch.stack([torch.arange(8), torch.arange(8, 16)], dim=1)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0x76543210
    assert packed[0, 1].item() == 0xFEDCBA98 - 2**32


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_pack_unpack_round_trip(dtype):
    torch.manual_seed(0)
    q = torch.randint(0, 16, (64, 24)).to(dtype)
    q[:8, 0] = 15  # every nibble of one word set: the sign bit of the packed int32
    packed = pack_int4(q)
    assert packed.shape == (8, 24) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed), q.to(torch.int32))
    assert torch.equal(pack_int4(unpack_int4(packed)), packed)


@pytest.mark.parametrize("case", ["k-not-multiple-of-8", "value-16", "negative", "float", "1-d"])
def test_pack_int4_rejects_bad_input(case):
    q = {"k-not-multiple-of-8": torch.zeros(12, 4, dtype=torch.int32),
         "value-16": torch.full((8, 4), 16), "negative": torch.full((8, 4), -1),
         "float": torch.zeros(8, 4), "1-d": torch.zeros(8, dtype=torch.int32)}[case]
    with pytest.raises(ValueError):
        pack_int4(q)


def test_unpack_int4_rejects_non_int32():
    with pytest.raises(ValueError):
        unpack_int4(torch.zeros(2, 4, dtype=torch.int64))


def dequantize_by_loop(qweight, scales, zeros, group_size):
    """Bit by bit from the layout's definition, with Python ints and floats."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    words = qweight.tolist()
    s, z = scales.float().tolist(), zeros.float().tolist()
    w = torch.empty(n, k, dtype=torch.float64)
    for i in range(n):
        for j in range(k):
            word = words[j // 8][i] & 0xFFFFFFFF
            code = (word >> (4 * (j % 8))) & 0xF
            w[i, j] = (code - z[j // group_size][i]) * s[j // group_size][i]
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group_size", [8, 16, 48])
def test_dequantize_ref_matches_loop(dtype, group_size):
    torch.manual_seed(1)
    _, qweight, scales, zeros = make_weights(5, 48, group_size, dtype, device="cpu")
    w = dequantize_int4_ref(qweight, scales, zeros, group_size)
    assert w.shape == (5, 48) and w.dtype == dtype
    torch.testing.assert_close(w, dequantize_by_loop(qweight, scales, zeros, group_size).to(dtype), atol=0, rtol=0)


def test_matmul_ref_uses_dequantized_weight_and_bias():
    torch.manual_seed(2)
    _, qweight, scales, zeros = make_weights(6, 32, 16, torch.float32, device="cpu")
    x, bias = torch.randn(3, 32), torch.randn(6)
    w = dequantize_by_loop(qweight, scales, zeros, 16)
    want = (x.double() @ w.t() + bias.double()).float()
    torch.testing.assert_close(w4a16_matmul_ref(x, qweight, scales, zeros, 16, bias), want, atol=1e-5, rtol=1e-5)


# --- the Triton kernel --------------------------------------------------------------------------


def check_kernel(m, n, k, group_size, dtype, split_k=None, bias=False, x_row_stride=None, symmetric=False):
    _, qweight, scales, zeros = make_weights(n, k, group_size, dtype, symmetric=symmetric)
    if x_row_stride is None:
        x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    else:  # rows of a wider buffer (a slice of a fused projection)
        x = torch.randn(m, x_row_stride, dtype=dtype, device=DEVICE)[:, 3 : 3 + k]
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    out = w4a16_matmul(x, qweight, scales, zeros, group_size, b, split_k=split_k)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = w4a16_matmul_ref(x, qweight, scales, zeros, group_size, b)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256], ids=lambda g: "channelwise" if g == 256 else f"g{g}")
@pytest.mark.parametrize("split_k", [None, 1, 3])
def test_matches_reference(dtype, m, group_size, split_k, nan_buffers):
    torch.manual_seed(3)
    check_kernel(m, 80, 256, group_size, dtype, split_k=split_k)  # N = 80: a partial column tile


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("group_size,k", [(40, 200), (8, 136), (200, 200), (24, 72)],
                         ids=["g40", "g8", "channelwise-k200", "g24-short-k"])
def test_group_sizes_off_the_power_of_two_grid(group_size, k, split_k, nan_buffers):
    """Groups no power-of-two tile fits (per-row scale path) and K not a multiple of the tile."""
    torch.manual_seed(4)
    check_kernel(5, 48, k, group_size, torch.float32, split_k=split_k)


@pytest.mark.parametrize("split_k", [1, 2])
def test_bias_and_strided_x_rows(split_k, nan_buffers):
    torch.manual_seed(5)
    check_kernel(7, 72, 128, 32, torch.float16, split_k=split_k, bias=True, x_row_stride=200)
    check_kernel(2, 72, 128, 128, torch.float32, split_k=split_k, bias=True, x_row_stride=131)


def test_symmetric_zero_point():
    torch.manual_seed(6)
    check_kernel(4, 64, 128, 64, torch.float16, symmetric=True)


def test_split_k_is_deterministic_and_agrees_with_one_pass(nan_buffers):
    torch.manual_seed(7)
    _, qweight, scales, zeros = make_weights(64, 256, 32, torch.float32)
    x = torch.randn(2, 256, device=DEVICE)
    one = w4a16_matmul(x, qweight, scales, zeros, 32, split_k=1)
    split = w4a16_matmul(x, qweight, scales, zeros, 32, split_k=4)
    assert torch.equal(split, w4a16_matmul(x, qweight, scales, zeros, 32, split_k=4))
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)


def test_default_config_splits_only_when_output_tiles_are_few():
    cpu = torch.device("cpu")
    assert w4a16_config(1, 80, 256, 32, torch.float16, cpu).split_k > 1
    assert w4a16_config(1, 4096, 4096, 128, torch.bfloat16, cpu).split_k > 1
    assert w4a16_config(64, 4096, 4096, 128, torch.bfloat16, cpu).split_k > 1
    assert w4a16_config(256, 28672, 4096, 128, torch.bfloat16, cpu).split_k == 1  # 896 tiles fill the GPU
    assert w4a16_config(512, 4096, 4096, 128, torch.bfloat16, cpu).split_k == 1  # prefill: never split
    # Never more splits than K tiles (an empty split would leave its partial unwritten).
    cfg = w4a16_config(1, 16, 64, 32, torch.float16, cpu, split_k=64)
    assert cfg.split_k <= -(-64 // cfg.block_k)


def test_empty_batch():
    _, qweight, scales, zeros = make_weights(16, 64, 32, torch.float32)
    out = w4a16_matmul(torch.empty(0, 64, device=DEVICE), qweight, scales, zeros, 32)
    assert out.shape == (0, 16)


BAD_INPUTS = ["group-not-dividing-k", "group-not-multiple-of-8", "group-zero", "scales-shape", "zeros-shape",
              "x-k-mismatch", "x-3d", "x-int", "scales-dtype", "zeros-dtype", "qweight-int64", "qweight-1d",
              "bias-shape", "bias-dtype", "x-strided-last-dim", "split-k-zero"]


@pytest.mark.parametrize("fn", [w4a16_matmul, w4a16_matmul_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_raise_value_error(fn, case):
    _, qweight, scales, zeros = make_weights(16, 64, 32, torch.float16)
    x = torch.randn(3, 64, dtype=torch.float16, device=DEVICE)
    kwargs = {"group_size": 32, "bias": None}
    if case == "group-not-dividing-k":
        kwargs["group_size"] = 48
    elif case == "group-not-multiple-of-8":
        kwargs["group_size"] = 4
    elif case == "group-zero":
        kwargs["group_size"] = 0
    elif case == "scales-shape":
        scales = scales[:1]
    elif case == "zeros-shape":
        zeros = zeros[:, :8]
    elif case == "x-k-mismatch":
        x = x[:, :56]
    elif case == "x-3d":
        x = x[None]
    elif case == "x-int":
        x = x.to(torch.int32)
    elif case == "scales-dtype":
        scales = scales.float()
    elif case == "zeros-dtype":
        zeros = zeros.float()
    elif case == "qweight-int64":
        qweight = qweight.long()
    elif case == "qweight-1d":
        qweight = qweight.flatten()
    elif case == "bias-shape":
        kwargs["bias"] = torch.zeros(15, dtype=torch.float16, device=DEVICE)
    elif case == "bias-dtype":
        kwargs["bias"] = torch.zeros(16, dtype=torch.float32, device=DEVICE)
    elif case == "x-strided-last-dim":
        if fn is w4a16_matmul_ref:
            pytest.skip("the reference reads any strides")
        x = torch.randn(64, 3, dtype=torch.float16, device=DEVICE).t()
    elif case == "split-k-zero":
        if fn is w4a16_matmul_ref:
            pytest.skip("the reference has no split")
        kwargs["split_k"] = 0
    with pytest.raises(ValueError):
        fn(x, qweight, scales, zeros, **kwargs)


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from deepbatch.kernels import w4a16_gemm as m\n"
        "qw = m.pack_int4(torch.randint(0, 16, (16, 4)))\n"
        "s = torch.ones(1, 4); z = torch.full((1, 4), 8.0)\n"
        "m.w4a16_matmul_ref(torch.randn(2, 16), qw, s, z, 16)\n"
        "try:\n"
        "    m.w4a16_matmul(torch.randn(2, 16), qw, s, z, 16)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


# --- GPU: bf16 (the interpreter's bf16 dot is not faithful) and model-sized shapes ---------------


def rel_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 128, 256])
@pytest.mark.parametrize("n,k,group_size", [(4096, 4096, 128), (6144, 4096, 4096), (4096, 11008, 64)],
                         ids=["4096x4096-g128", "6144x4096-channelwise", "4096x11008-g64"])
def test_gpu_large(dtype, m, n, k, group_size):
    torch.manual_seed(8)
    _, qweight, scales, zeros = make_weights(n, k, group_size, dtype, device="cuda")
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    bias = torch.randn(n, dtype=dtype, device="cuda")
    out = w4a16_matmul(x, qweight, scales, zeros, group_size, bias)
    ref = w4a16_matmul_ref(x, qweight, scales, zeros, group_size, bias)
    # Both round the same dequantized weight; only the summation order and the final rounding differ.
    assert rel_error(out, ref) < 5e-3
    if m <= 16:  # the split-K path against the one-pass kernel
        one = w4a16_matmul(x, qweight, scales, zeros, group_size, bias, split_k=1)
        assert rel_error(out, one) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("group_size", [32, 40, 256])
def test_gpu_bf16_small_shapes(m, group_size):
    torch.manual_seed(9)
    _, qweight, scales, zeros = make_weights(200, 1280, group_size, torch.bfloat16, device="cuda")
    x = torch.randn(m, 1300, dtype=torch.bfloat16, device="cuda")[:, 7:1287]
    out = w4a16_matmul(x, qweight, scales, zeros, group_size)
    assert rel_error(out, w4a16_matmul_ref(x, qweight, scales, zeros, group_size)) < 5e-3
