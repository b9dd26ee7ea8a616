"""Sampling by rejection against the one-program-per-row kernel and its sorting torch reference:
the same ids on crafted rows (ties at the top-k cut, -inf, min-p, temperatures, greedy rows) and
on random ones, whatever the number of rounds and the tile; rows finished by rejection are left
alone by the fallback; draws that follow the truncated distribution. On the CPU through the Triton
interpreter (a program costs milliseconds there, so the batches are small)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest  # noqa: E402

pytest.importorskip("triton")

import deepbatch.kernels.sample_rejection as rejection_mod  # noqa: E402
from sm90_build import build_for_sm90  # noqa: E402
from test_sample_top_k_top_p import CRAFTED, DRAW, DRAW_ROW, KEPT, batch, chi2_crit, chi2_stat, random_rows, truncated  # noqa: E402
from deepbatch.kernels.sample_rejection import sample_rejection  # noqa: E402
from deepbatch.kernels.sample_top_k_top_p import sample_top_k_top_p, sample_top_k_top_p_ref  # noqa: E402


@pytest.fixture
def fallback_rows(monkeypatch):
    """The rows each call leaves to the one-program-per-row kernel (not done by rejection)."""
    calls = []
    original = rejection_mod.sample_top_k_top_p

    def spy(*args, skip=None, out=None, **kwargs):
        calls.append((skip == 0).nonzero().flatten().tolist())
        return original(*args, skip=skip, out=out, **kwargs)

    monkeypatch.setattr(rejection_mod, "sample_top_k_top_p", spy)
    return calls


def test_crafted_rows_match_the_reference():
    """Every crafted kept set of the exact kernel's tests, sampled with several Philox offsets."""
    args = batch([row for row, _ in CRAFTED], vocab=40)
    for offset in (0, 2 ** 40):
        ids = sample_rejection(*args, 7, offset, block=16)
        assert torch.equal(ids, sample_top_k_top_p_ref(*args, 7, offset)), offset


@pytest.mark.parametrize("rounds,block,dtype", [(1, 64, torch.float32), (2, 16, torch.float16),
                                                (4, 512, torch.float32)], ids=["1-round", "2-rounds-fp16", "4-rounds"])
def test_random_rows_match_the_reference(rounds, block, dtype):
    args = random_rows(16, 300, seed=3, dtype=dtype)
    ids = sample_rejection(*args, 99, 2 ** 33, rounds=rounds, block=block)
    assert torch.equal(ids, sample_top_k_top_p_ref(*args, 99, 2 ** 33))
    assert torch.equal(ids, sample_top_k_top_p(*args, 99, 2 ** 33, block=64))


def test_flat_rows_at_small_top_p_take_more_rounds(fallback_rows):
    """Nearly flat rows at p = 0.3: a round accepts only some of them, so one round leaves many
    to the fallback, more rounds fewer, and the ids never change."""
    g = torch.Generator().manual_seed(5)
    S, V = 16, 200
    logits = (torch.randn(S, V, generator=g) * 0.2).to(DEVICE)
    full = lambda v, dt=torch.float32: torch.full((S,), v, dtype=dt, device=DEVICE)  # noqa: E731
    args = (logits, full(1.0), full(-1, torch.int32), full(0.3), full(0.0), full(0, torch.int64),
            full(0, torch.int64), full(False, torch.bool))
    ref = sample_top_k_top_p_ref(*args, 3, 0)
    for rounds in (1, 2, 8):
        assert torch.equal(sample_rejection(*args, 3, 0, rounds=rounds, block=64), ref)
    left = [len(rows) for rows in fallback_rows]
    assert left[0] > left[1] >= left[2] and left[0] >= S // 4, left


def test_rows_without_top_p_finish_in_one_round(fallback_rows):
    """Temperature, seeds and top-k alone: the first winner is in the kept set (the floor starts at
    the top-k cut); min-p rows need at most a second round, once the row max is known."""
    rows = [dict(logits=[float(v % 7) for v in range(50)], T=t, k=k, seed=s)
            for t in (0.5, 1.0, 0.0) for k in (-1, 1, 3, 20) for s in (None, 11)]
    args = batch(rows)
    assert torch.equal(sample_rejection(*args, 1, 0, rounds=1, block=16), sample_top_k_top_p_ref(*args, 1, 0))
    min_p_rows = batch([dict(logits=DRAW_ROW, T=1.3, min_p=0.5)] * 12)
    assert torch.equal(sample_rejection(*min_p_rows, 2, 0, rounds=2, block=16),
                       sample_top_k_top_p_ref(*min_p_rows, 2, 0))
    assert fallback_rows == []  # no top-p: every row finished by rejection, no fallback launched


def test_hints_read_from_the_tensors_when_absent():
    args = random_rows(8, 120, seed=4)
    ref = sample_top_k_top_p_ref(*args, 5, 0)
    assert torch.equal(sample_rejection(*args, 5, 0, block=32), ref)
    top_k = args[2]
    hinted = sample_rejection(*args, 5, 0, block=32, max_top_k=int(top_k.max()), any_top_p=True)
    assert torch.equal(hinted, ref)


def test_exact_kernel_skips_rows_it_is_told_to():
    args = random_rows(6, 100, seed=6)
    skip = torch.tensor([True, False, True, False, False, True], device=DEVICE)
    out = torch.full((6,), -7, dtype=torch.int64, device=DEVICE)
    got = sample_top_k_top_p(*args, 8, 0, block=32, skip=skip, out=out)
    ref = sample_top_k_top_p_ref(*args, 8, 0)
    assert got is out
    assert (out[skip] == -7).all() and torch.equal(out[~skip], ref[~skip])


def test_draws_follow_the_truncated_distribution():
    """150 draws of the top-k + top-p + min-p row (the exact kernel's test): the truncated
    renormalised distribution passes, the row at half the temperature fails."""
    args = batch([DRAW] * 150)
    counts = torch.bincount(sample_rejection(*args, 2024, 0, block=16).cpu(), minlength=len(DRAW_ROW)).double()
    crit = chi2_crit(len(KEPT) - 1)
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.8, KEPT)) < crit
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.4, KEPT)) > crit


def test_empty_batch_and_bad_inputs():
    args = random_rows(4, 64, seed=1)
    empty = tuple(a[:0] for a in args)
    assert sample_rejection(*empty, 1, 0).shape == (0,)
    with pytest.raises(ValueError, match="block"):
        sample_rejection(*args, 1, 0, block=48)
    with pytest.raises(ValueError, match="rounds"):
        sample_rejection(*args, 1, 0, rounds=0)
    with pytest.raises(ValueError, match="top_k"):
        sample_rejection(args[0], args[1], args[2].long(), *args[3:], 1, 0)


_COMPILE_SM90 = """
import sys
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from deepbatch.kernels import sample_rejection as k
if "nvidia" not in backends:
    sys.exit(3)
def build(fn, sig, consts, warps):
    sig = dict(sig, **{name: "constexpr" for name in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
    print(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__, "ok")
f, i32, i64 = "*fp32", "*i32", "*i64"
for first, has_k in ((True, True), (False, False)):
    build(k._candidates_kernel, {"logits_ptr": "*bf16", "fparams_ptr": f, "iparams_ptr": i64, "kth_ptr": "*bf16",
          "work_ptr": f, "tile_work_ptr": f, "best_idx_ptr": i64, "w_ptr": i64, "state_ptr": i32, "out_ptr": i64,
          "vocab": "i32", "stride_row": "i32", "philox_seed": "i64", "philox_offset": "i64"},
          {"BLOCK": 4096, "TILES": 64, "FIRST": first, "HAS_K": has_k}, 8)
build(k._mass_above_kernel, {"logits_ptr": "*bf16", "fparams_ptr": f, "work_ptr": f, "tile_work_ptr": f, "w_ptr": i64,
      "state_ptr": i32, "out_ptr": i64, "vocab": "i32", "stride_row": "i32"}, {"BLOCK": 4096, "TILES": 64}, 8)
"""


def test_compiles_for_sm90():
    """Built as an H200 would (the interpreter accepts constructs the compiler rejects)."""
    assert build_for_sm90(_COMPILE_SM90).split() == [
        "_candidates_kernel", "ok", "_candidates_kernel", "ok", "_mass_above_kernel", "ok"]


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_large_vocab_matches_the_exact_kernel(dtype):
    """The 152k vocab at the default tile: the exact kernel's ids for nearly every row (their
    masses are float32 sums in different orders, which can move a token that sits on a cut)."""
    g = torch.Generator().manual_seed(11)
    S, V = 256, 151936
    args = list(random_rows(S, V, seed=12, dtype=dtype))
    args[0] = (torch.randn(S, V, generator=g) * 3).to(dtype).to(DEVICE)
    ids = sample_rejection(*args, 9, 0)
    assert (ids == sample_top_k_top_p(*args, 9, 0)).float().mean().item() >= 252 / 256
    assert (ids == sample_top_k_top_p_ref(*args, 9, 0)).float().mean().item() >= 250 / 256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_twenty_thousand_draws_follow_the_distribution():
    args = batch([DRAW] * 20000)
    counts = torch.bincount(sample_rejection(*args, 77, 12345).cpu(), minlength=len(DRAW_ROW)).double()
    crit = chi2_crit(len(KEPT) - 1)
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.8, KEPT)) < crit
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.9, KEPT)) > crit


@pytest.mark.parametrize("V,group", [(4096, 32), (5000, 32), (4100, 16)], ids=["whole", "tail", "small-groups"])
def test_kth_largest_equals_torch_topk(V, group):
    """Exact, ties included: rows of few distinct values (every group max ties) and rows whose top
    logits crowd into one group or sit past the last whole group."""
    from deepbatch.kernels.sample_rejection import kth_largest

    gen = torch.Generator().manual_seed(V)
    S, max_k = 6, 24
    x = torch.randn(S, V, generator=gen) * 3
    x[1] = torch.randint(0, 4, (V,), generator=gen).float()  # four values: ties everywhere
    x[2, 64:64 + group] = 50.0 + torch.arange(group).float()  # the best in one group
    x[3, V - (V % group or group):] = 40.0  # in the tail (or the last group)
    x[4, ::3] = float("-inf")
    x[5] = float("-inf")
    x[5, 7] = 1.0
    top_k = torch.tensor([1, 5, 24, 7, 24, 3], dtype=torch.int32)
    got = kth_largest(x.to(DEVICE), top_k.to(DEVICE), max_k, group=group).cpu()
    want = x.topk(max_k, dim=1).values.gather(1, (top_k.long() - 1).unsqueeze(1)).squeeze(1)
    assert torch.equal(got, want)
