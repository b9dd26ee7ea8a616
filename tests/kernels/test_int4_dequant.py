"""The one-pass int4 dequantization kernel (``kernels/int4_dequant.py``) held bit for bit to
``dequantize_int4_ref``, which ``tests/kernels/test_w4a16_gemm.py`` holds to an element-by-element
loop. Runs on the CPU through the Triton interpreter (fp16 and fp32: the interpreter's bf16
rounding is not faithful); the bf16 test needs a GPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.int4_dequant import dequantize_int4, dequantize_int4_config  # noqa: E402
from deepbatch.kernels.w4a16_gemm import dequantize_int4_ref, pack_int4  # noqa: E402


def make_weights(n, k, group_size, dtype, symmetric, seed=0, device=DEVICE):
    """Random codes (every nibble value, the sign bit of the packed words included), scales over two
    decades so that a scale read from the wrong group or column shows, integer or half-integer zero
    points (8.0 when symmetric)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group_size
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = torch.logspace(-3, -1, groups * n).view(groups, n)[:, torch.randperm(n, generator=g)]
    if symmetric:
        zeros = torch.full((groups, n), 8.0)
    else:
        zeros = torch.randint(0, 16, (groups, n), generator=g).float() + torch.randint(0, 2, (groups, n), generator=g) * 0.5
    return pack_int4(q).to(device), scales.to(dtype).to(device), zeros.to(dtype).to(device)


# (N, K, group_size): one tile and many; group sizes whose tiles lie inside one group (16 .. 128
# and beyond), one group over all of K, and group sizes with no power-of-two divisor >= 16 (the
# per-channel scale path), where K is not a multiple of the tile; N off the tile width.
SHAPES = [
    (64, 128, 128),
    (96, 384, 128),
    (200, 256, 256),
    (72, 96, 32),
    (40, 64, 16),
    (48, 200, 40),
    (24, 200, 200),
    (130, 72, 24),
]


@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-points", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, group_size", SHAPES, ids=str)
def test_matches_reference_exactly(n, k, group_size, dtype, symmetric):
    qweight, scales, zeros = make_weights(n, k, group_size, dtype, symmetric, seed=n + k)
    want = dequantize_int4_ref(qweight, scales, zeros, group_size)
    got = dequantize_int4(qweight, scales, zeros, group_size)
    assert got.dtype == dtype and got.shape == (n, k) and got.is_contiguous()
    assert torch.equal(got, want)


def test_tile_boundaries_are_covered():
    # The configs these shapes take: a K not a multiple of BLOCK_K and an N not a multiple of
    # BLOCK_N, so the masked tails are exercised above, not only full tiles.
    block_k, block_n = dequantize_int4_config(48, 200, 40)
    assert 200 % block_k and 48 % block_n
    block_k, block_n = dequantize_int4_config(130, 72, 24)
    assert 72 % block_k and 130 % block_n


def test_every_element_written(monkeypatch):
    # A NaN-filled output that the kernel must overwrite completely: an unwritten tail shows.
    qweight, scales, zeros = make_weights(130, 200, 40, torch.float32, symmetric=False)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    got = dequantize_int4(qweight, scales, zeros, 40)
    monkeypatch.undo()
    assert not got.isnan().any()
    assert torch.equal(got, dequantize_int4_ref(qweight, scales, zeros, 40))


def test_empty_weight():
    qweight, scales, zeros = make_weights(0, 64, 32, torch.float16, symmetric=True)
    assert dequantize_int4(qweight, scales, zeros, 32).shape == (0, 64)


@pytest.mark.parametrize("case, match", [
    ("group-size", "group_size must be a positive multiple of 8"),
    ("group-not-dividing", "does not divide K"),
    ("scales-shape", "scales must be"),
    ("zeros-dtype", "zeros dtype"),
    ("qweight-dtype", "qweight must be int32"),
    ("strided-scales", "contiguous last dimension"),
])
def test_bad_inputs_raise_value_error(case, match):
    qweight, scales, zeros = make_weights(64, 128, 32, torch.float32, symmetric=False)
    group_size = 32
    if case == "group-size":
        group_size = 12
    elif case == "group-not-dividing":
        group_size = 48
    elif case == "scales-shape":
        scales = scales[:2]
    elif case == "zeros-dtype":
        zeros = zeros.half()
    elif case == "qweight-dtype":
        qweight = qweight.to(torch.int64)
    elif case == "strided-scales":
        scales = scales.t().contiguous().t()
    with pytest.raises(ValueError, match=match):
        dequantize_int4(qweight, scales, zeros, group_size)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-points", "symmetric"])
@pytest.mark.parametrize("n, k, group_size", [(6144, 4096, 128), (4096, 14336, 128), (4096, 4096, 4096),
                                              (1000, 1000, 40)], ids=str)
def test_gpu_bf16_matches_reference_exactly(n, k, group_size, symmetric):
    qweight, scales, zeros = make_weights(n, k, group_size, torch.bfloat16, symmetric, seed=k, device="cuda")
    want = dequantize_int4_ref(qweight, scales, zeros, group_size)
    assert torch.equal(dequantize_int4(qweight, scales, zeros, group_size), want)
