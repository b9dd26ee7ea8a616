"""The Triton fused MoE (sort by expert + grouped GEMMs) held to ``fused_moe_ref``, and the
reference held to a per-token loop. Runs on the CPU through the Triton interpreter."""

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
import torch.nn.functional as F

pytest.importorskip("triton")

from deepbatch.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from deepbatch.kernels.moe_align import sort_pairs_by_expert  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture
def nan_buffers(monkeypatch):
    """Float buffers the wrapper allocates start as NaN: a pair row no tile writes shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def make_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, device=DEVICE, skewed=False):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device) / hidden**0.5)
    w2 = (torch.randn(num_experts, hidden, inter, dtype=dtype, device=device) / inter**0.5)
    if skewed:  # most tokens on expert 0, the rest spread: long and empty runs side by side
        ids = torch.stack([torch.cat((torch.tensor([0]), 1 + torch.randperm(num_experts - 1)[: top_k - 1]))
                           for _ in range(num_tokens)])
    else:
        ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k)
    return x, w13, w2, weights.to(device), ids.to(device)


def per_token_loop(x, w13, w2, weights, ids):
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].float() @ x[t].float()
            out[t] += weights[t, k] * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def test_reference_equals_per_token_loop():
    torch.manual_seed(0)
    args = make_inputs(13, 8, 2, 64, 32, torch.float32, device="cpu")
    torch.testing.assert_close(fused_moe_ref(*args), per_token_loop(*args), atol=1e-5, rtol=1e-5)


def test_sort_pairs_by_expert_layout():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, expert_ids, num_padded = sort_pairs_by_expert(ids, num_experts=4, block_m=4)
    pad = ids.numel()
    used = int(num_padded)
    assert used == 12  # expert 0: 2 pairs, expert 1: 1, expert 3: 3; each run padded to 4
    assert sorted_ids[:used].tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert expert_ids[: used // 4].tolist() == [0, 1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape", [(1, 8, 2, 64, 32), (7, 8, 2, 64, 32), (40, 16, 4, 96, 48), (150, 8, 2, 64, 32)],
    ids=["decode-1", "t7", "t40-e16-k4-odd-dims", "t150-tall-tiles"],
)
def test_matches_reference(dtype, shape, nan_buffers):
    torch.manual_seed(1)
    x, w13, w2, weights, ids = make_inputs(*shape, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(out.cpu(), ref, **TOL[dtype])


def test_skewed_routing_and_int32_ids(nan_buffers):
    torch.manual_seed(2)
    x, w13, w2, weights, ids = make_inputs(50, 8, 3, 64, 32, torch.float32, skewed=True)
    out = fused_moe(x, w13, w2, weights, ids.int())
    torch.testing.assert_close(out.cpu(), fused_moe_ref(x, w13, w2, weights, ids).cpu(), **TOL[torch.float32])


@pytest.mark.parametrize("case", ["x-3d", "w2-shape", "ids-shape", "weights-fp16", "ids-float", "mixed-dtypes",
                                  "strided-x"])
def test_bad_inputs_raise_value_error(case):
    x, w13, w2, weights, ids = make_inputs(4, 8, 2, 64, 32, torch.float32)
    if case == "x-3d":
        x = x[None]
    elif case == "w2-shape":
        w2 = w2[:, :, :16]
    elif case == "ids-shape":
        ids = ids[:, :1]
    elif case == "weights-fp16":
        weights = weights.half()
    elif case == "ids-float":
        ids = ids.float()
    elif case == "mixed-dtypes":
        w13 = w13.half()
    elif case == "strided-x":
        x = x.t().contiguous().t()
    with pytest.raises(ValueError):
        fused_moe(x, w13, w2, weights, ids)


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from deepbatch.kernels import fused_moe as m\n"
        "x = torch.randn(3, 16)\n"
        "ids = torch.tensor([[0, 1]] * 3)\n"
        "m.fused_moe_ref(x, torch.randn(4, 8, 16), torch.randn(4, 16, 4), torch.rand(3, 2), ids)\n"
        "try:\n"
        "    m.fused_moe(*(None,) * 5)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_gpu_bf16_deepseek_dims(num_tokens):
    """DeepSeek-V2-Lite's experts: 64 of 1408 x 2048, top 6."""
    torch.manual_seed(3)
    x, w13, w2, weights, ids = make_inputs(num_tokens, 64, 6, 2048, 1408, torch.bfloat16, device="cuda")
    out = fused_moe(x, w13, w2, weights, ids).float().cpu()
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids).cpu()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 2e-2, rel
