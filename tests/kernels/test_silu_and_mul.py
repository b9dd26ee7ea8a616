"""The Triton gated activation held to ``silu_and_mul_ref``, on the CPU through the Triton interpreter."""

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

from deepbatch.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def check(x):
    ref = silu_and_mul_ref(x)
    got = silu_and_mul(x)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 400), (2, 3, 128), (5, 3000)], ids=str)
def test_matches_reference(dtype, shape):
    torch.manual_seed(0)
    check(torch.randn(shape, dtype=dtype, device=DEVICE) * 4)


def test_strided_rows():
    torch.manual_seed(1)
    check(torch.randn(9, 300, device=DEVICE)[:, :256])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_extremes_stay_finite():
    x = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1.0, 2.0, 3.0, 4.0]], device=DEVICE)
    check(x)


@pytest.mark.parametrize("case", ["odd-last-dim", "int-dtype", "strided-last-dim"])
def test_bad_inputs_raise_value_error(case):
    x = {"odd-last-dim": torch.randn(4, 7), "int-dtype": torch.ones(4, 8, dtype=torch.int32),
         "strided-last-dim": torch.randn(8, 4).t()}[case]
    with pytest.raises(ValueError):
        silu_and_mul(x)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_large():
    torch.manual_seed(2)
    check(torch.randn(2000, 2 * 11008, dtype=torch.bfloat16, device="cuda") * 4)
