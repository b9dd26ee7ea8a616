"""The Triton RMSNorm held to ``rms_norm_ref`` (HF Llama semantics), on the CPU through the Triton
interpreter."""

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

from deepbatch.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def check(x, weight, residual, eps=1e-6):
    ref = rms_norm_ref(x, weight, eps, residual)
    got = rms_norm(x, weight, eps, residual)
    if residual is None:
        ref, got = (ref,), (got,)
    else:
        # The new residual is one rounded add in both: exact.
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert got[0].dtype == ref[0].dtype and got[0].shape == ref[0].shape
    torch.testing.assert_close(got[0], ref[0], **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(37, 96), (3, 5, 64)], ids=str)
def test_matches_reference(dtype, with_residual, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    residual = torch.randn(shape, dtype=dtype, device=DEVICE) if with_residual else None
    check(x, weight, residual)


def test_strided_rows_and_float32_weight():
    torch.manual_seed(1)
    # A slice of a wider projection (MLA's latent next to its rope part), fp32 weight: output promotes.
    x = torch.randn(11, 160, dtype=torch.float16, device=DEVICE)[:, :128]
    check(x, torch.randn(128, device=DEVICE), None)
    residual = torch.randn(11, 128, dtype=torch.float16, device=DEVICE)
    check(x, torch.randn(128, dtype=torch.float16, device=DEVICE), residual)


def test_inputs_are_not_modified():
    x, r = torch.randn(4, 64, device=DEVICE), torch.randn(4, 64, device=DEVICE)
    x0, r0 = x.clone(), r.clone()
    rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, r)
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("case", ["weight-shape", "residual-shape", "residual-dtype", "int-dtype", "strided-last-dim"])
def test_bad_inputs_raise_value_error(case):
    x, weight, residual = torch.randn(4, 64), torch.ones(64), None
    if case == "weight-shape":
        weight = torch.ones(32)
    elif case == "residual-shape":
        residual = torch.randn(4, 32)
    elif case == "residual-dtype":
        residual = torch.randn(4, 64, dtype=torch.float16)
    elif case == "int-dtype":
        x = x.int()
    elif case == "strided-last-dim":
        x = torch.randn(64, 4).t()
    with pytest.raises(ValueError):
        rms_norm(x, weight, 1e-6, residual)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gpu_bf16_large(with_residual):
    torch.manual_seed(2)
    x = torch.randn(2000, 4096, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x) if with_residual else None
    check(x, torch.randn(4096, dtype=torch.bfloat16, device="cuda"), residual)
