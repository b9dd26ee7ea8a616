"""The fused logprobs kernel held to ``logprobs_topk_ref``, on the CPU through the Triton interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.logprobs_topk import logprobs_topk, logprobs_topk_ref  # noqa: E402
from sm90_build import build_for_sm90  # noqa: E402


def check(logits: torch.Tensor, tokens: torch.Tensor, k: int, block: int) -> torch.Tensor:
    out = logprobs_topk(logits, tokens, k, block=block)
    ref = logprobs_topk_ref(logits, tokens, k)
    assert out.shape == ref.shape == (logits.shape[0], 2 + 2 * k)
    torch.testing.assert_close(out[:, :1], ref[:, :1], rtol=1e-5, atol=1e-5)  # the sampled token's logprob
    assert torch.equal(out[:, 1], ref[:, 1])  # its rank
    torch.testing.assert_close(out[:, 2:2 + k], ref[:, 2:2 + k], rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("S,V,k,block", [
    (3, 1000, 5, 256),  # several tiles, the last one partial
    (2, 5000, 20, 512),  # the most logprobs a request may ask for
    (4, 300, 0, 64),  # only the sampled token
    (1, 7, 3, 16),  # a vocab smaller than a block
], ids=["tiles", "k20", "k0", "tiny"])
def test_matches_reference(S, V, k, block):
    gen = torch.Generator().manual_seed(S * V + k)
    logits = (torch.randn(S, V, generator=gen) * 3).to(DEVICE)
    tokens = torch.randint(0, V, (S,), generator=gen).to(DEVICE)
    tokens[0] = logits[0].argmax()  # the most likely token: rank 1
    out = check(logits, tokens, k, block)
    ref = logprobs_topk_ref(logits, tokens, k)
    assert out[0, 1] == 1
    assert torch.equal(out[:, 2 + k:], ref[:, 2 + k:])  # no ties: the same ids in the same order


def test_half_precision_logits():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 2000, generator=gen) * 3).to(DEVICE, torch.float16)
    tokens = torch.randint(0, 2000, (3,), generator=gen).to(DEVICE)
    check(logits, tokens, 4, 256)


def test_ties_and_masked_rows():
    """Equal logits list the lowest column first; a row with fewer finite logits than k (a grammar
    left it one token) still lists k distinct tokens, the masked ones at -inf."""
    V, k = 600, 6
    logits = torch.full((2, V), float("-inf"))
    logits[0] = 1.0
    logits[0, 450] = 2.0
    logits[1, 333] = 0.5
    logits = logits.to(DEVICE)
    tokens = torch.tensor([450, 333]).to(DEVICE)
    out = logprobs_topk(logits, tokens, k, block=128).cpu()
    assert out[0, 2 + k:].tolist() == [450, 0, 1, 2, 3, 4]
    assert out[0, 1] == 1 and out[1, 1] == 1
    assert out[1, 0] == 0 and out[1, 2] == 0  # the one finite logit holds all the mass
    assert torch.isneginf(out[1, 3:2 + k]).all()
    ids = out[1, 2 + k:].tolist()
    assert ids[0] == 333 and len(set(ids)) == k and all(0 <= i < V for i in ids)


def test_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        logprobs_topk(torch.zeros(1, 100, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), 21)


def test_covers_every_request():
    from deepbatch.core.sampling_params import MAX_LOGPROBS
    from deepbatch.kernels.logprobs_topk import MAX_K

    assert MAX_K == MAX_LOGPROBS


def test_sampler_logprobs_through_the_kernel_equal_the_torch_path():
    """The engine's entries (the sampled token first, then the top k, with ranks) are the same
    whichever computes them; greedy rows, so both paths sample the same tokens."""
    from deepbatch.core.request import Request
    from deepbatch.core.sampling_params import SamplingParams
    from deepbatch.sampling.sampler import Sampler

    vocab = 3000
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, vocab, generator=gen) * 3).to(DEVICE)
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in (0, 3, None, 20)]
    batch = [Request(f"r{i}", [1, 2, 3], p, max_tokens=8) for i, p in enumerate(params)]
    fused = Sampler(vocab, DEVICE, fused=True).sample(logits.clone(), batch).resolve()
    torch_path = Sampler(vocab, DEVICE, fused=False).sample(logits.clone(), batch).resolve()
    assert fused.token_ids == torch_path.token_ids
    assert fused.logprobs[2] is None and torch_path.logprobs[2] is None
    for a, b, p in zip(fused.logprobs, torch_path.logprobs, params):
        if p.logprobs is None:
            continue
        assert list(a) == list(b) and len(a) == max(p.logprobs, 1)
        for tok in a:
            assert a[tok].rank == b[tok].rank
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-5


_COMPILE_SM90 = """
import sys
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from deepbatch.kernels import logprobs_topk as k
if "nvidia" not in backends:
    sys.exit(3)
for logits in ("*fp32", "*bf16"):
    sig = {"logits_ptr": logits, "token_ptr": "*i64", "tile_stats_ptr": "*fp32", "cand_ptr": "*fp32",
           "arrivals_ptr": "*i32", "out_ptr": "*fp32", "vocab": "i32", "stride_row": "i32", "k": "i32"}
    consts = {"BLOCK": 4096, "TILES": 64, "KPAD": 32}
    sig.update({name: "constexpr" for name in consts})
    triton.compile(ASTSource(fn=k._logprobs_topk_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    print("ok")
"""


def test_compiles_for_sm90():
    """Built as an H200 would (the interpreter accepts constructs the compiler rejects)."""
    assert build_for_sm90(_COMPILE_SM90).split() == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_gpu_decode_shape(dtype, k):
    S, V = 256, 151936
    gen = torch.Generator().manual_seed(k)
    logits = (torch.randn(S, V, generator=gen) * 4).to("cuda", dtype)
    tokens = torch.randint(0, V, (S,), generator=gen).cuda()
    out = logprobs_topk(logits, tokens, k)
    ref = logprobs_topk_ref(logits, tokens, k)
    torch.testing.assert_close(out[:, 0], ref[:, 0], rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, 1], ref[:, 1])
    torch.testing.assert_close(out[:, 2:2 + k], ref[:, 2:2 + k], rtol=1e-5, atol=1e-4)
    # bf16 logits tie often: the ids may differ in order among equal values, never in value.
    picked = logits.float().gather(1, out[:, 2 + k:].long())
    torch.testing.assert_close(picked, ref[:, 2:2 + k] + torch.logsumexp(logits.float(), -1, keepdim=True),
                               rtol=1e-5, atol=1e-4)
