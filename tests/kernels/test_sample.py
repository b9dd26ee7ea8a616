"""The Gumbel-max sampling kernel: greedy rows are torch.argmax exactly, temperature rows follow
softmax(l / T), draws are a function of (seed, offset) alone; and the sampler uses it only for the
batches it covers. On the CPU through the Triton interpreter (one Philox program costs tens of
milliseconds there, so the draws below are counted in hundreds)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

import deepbatch.sampling.sampler as sampler_mod  # noqa: E402
from sm90_build import build_for_sm90  # noqa: E402
from deepbatch.core.request import Request  # noqa: E402
from deepbatch.core.sampling_params import SamplingParams  # noqa: E402
from deepbatch.kernels.sample import counters_used, gumbel_sample, gumbel_sample_ref  # noqa: E402
from deepbatch.kernels.sample_rejection import sample_rejection  # noqa: E402
from deepbatch.sampling.sampler import Sampler  # noqa: E402

NEG_INF = float("-inf")
# Seven finite logits and one -inf; at T = 0.7 the rarest finite token has p = 0.005.
SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, NEG_INF])
T = 0.7
# chi-square critical value for 6 degrees of freedom (7 finite tokens) at alpha = 1e-4. Against
# 600 draws at T = 0.7 the statistic of a wrong temperature is expected far above it: about 110
# with the temperature ignored (T = 1), 470 inverted (T = 1 / 0.7), thousands at T = 0.35.
CHI2_CRIT = 27.86


def tricky_logits(rows: int, vocab: int, dtype=torch.float32) -> torch.Tensor:
    """Random rows with the argmax's edge cases: ties within and across tiles, -inf entries, a
    max in the last column, a row of all -inf."""
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g)
    x[:, ::7] = NEG_INF
    x[0, 3] = x[0, vocab - 2] = 9.0  # tie across tiles: the lower index wins
    if rows > 1:
        x[1, 10] = x[1, 11] = 9.0  # tie within a tile
        x[-1, vocab - 1] = 9.0
    if rows > 2:
        x[2] = NEG_INF  # all -inf: index 0, as torch.argmax
    return x.to(dtype).to(DEVICE)


def chi2(ids: torch.Tensor, logits: torch.Tensor, temperature: float) -> float:
    """Pearson's statistic of the draws against softmax(logits / temperature) over the finite
    tokens (a draw of a -inf token fails outright)."""
    finite = torch.isfinite(logits)
    counts = torch.bincount(ids.cpu(), minlength=len(logits)).double()
    assert counts[~finite].sum() == 0, "drew a -inf token"
    expected = torch.softmax(logits.double() / temperature, 0)[finite] * len(ids)
    return float(((counts[finite] - expected) ** 2 / expected).sum())


# -- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("vocab,block", [(1000, 4096), (4999, 256)], ids=["one-tile", "tiles"])
def test_greedy_rows_are_argmax(dtype, rows, vocab, block):
    x = tricky_logits(rows, vocab, dtype)
    got = gumbel_sample(x, torch.zeros(rows, device=DEVICE), seed=1, offset=0, block=block)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_greedy_strided_rows():
    x = tricky_logits(5, 3000)[:, :2500]  # a row stride wider than the vocab
    got = gumbel_sample(x, torch.zeros(5, device=DEVICE), 1, 0, block=512)
    assert torch.equal(got, x.argmax(dim=-1))


# -- temperature ------------------------------------------------------------------------------


def draws(logits_row, inv_t, calls=4, rows=150, seed=5):
    """``calls * rows`` draws of one row, each call at the next unused offset."""
    x = logits_row.to(DEVICE).repeat(rows, 1)
    inv = torch.full((rows,), inv_t, device=DEVICE)
    step = counters_used(rows, x.shape[1])
    return torch.cat([gumbel_sample(x, inv, seed, k * step, block=8) for k in range(calls)])


def test_temperature_rows_follow_softmax():
    ids = draws(SMALL, 1 / T)
    assert chi2(ids, SMALL, T) < CHI2_CRIT
    # The same check cannot pass with the temperature ignored, inverted or halved.
    for wrong in (1.0, 1 / T, T / 2):
        assert chi2(ids, SMALL, wrong) > CHI2_CRIT, wrong


def test_reference_follows_softmax():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = SMALL.to(DEVICE).repeat(600, 1)
    ids = gumbel_sample_ref(x, torch.full((600,), 1 / T, device=DEVICE), generator=g)
    assert chi2(ids, SMALL, T) < CHI2_CRIT
    assert chi2(ids, SMALL, 1.0) > CHI2_CRIT
    greedy = gumbel_sample_ref(tricky_logits(5, 1000), torch.zeros(5, device=DEVICE))
    assert torch.equal(greedy, tricky_logits(5, 1000).argmax(dim=-1))


def test_neg_inf_never_drawn():
    # Three finite tokens in a row of -inf, at a temperature high enough that the noise
    # dominates; and a row whose only finite token must always win.
    x = torch.full((4, 1500), NEG_INF)
    x[:3, [5, 700, 1499]] = torch.tensor([0.0, 3.0, -2.0])
    x[3, 1234] = -50.0
    x = x.to(DEVICE)
    inv = torch.tensor([0.01, 1.0, 100.0, 1.0], device=DEVICE)
    for k in range(5):
        got = gumbel_sample(x, inv, seed=9, offset=k * counters_used(4, 1500), block=512).tolist()
        assert all(t in (5, 700, 1499) for t in got[:3]) and got[3] == 1234


def test_cold_temperature_is_argmax():
    x = tricky_logits(5, 2000)
    x[0, 1998] = x[1, 11] = 8.0  # no ties: a sampled row picks among tied tokens at random
    x[2, 17] = 0.0  # the all -inf row gets one finite token
    got = gumbel_sample(x, torch.full((5,), 1e4, device=DEVICE), 3, 0, block=1024)
    assert torch.equal(got, x.argmax(dim=-1))


def test_mixed_greedy_and_temperature():
    x = tricky_logits(5, 3001)
    inv = torch.tensor([0.0, 1.0, 0.0, 1 / 0.6, 0.0], device=DEVICE)
    got = gumbel_sample(x, inv, 11, 0, block=1024)
    greedy = inv == 0
    assert torch.equal(got[greedy], x.argmax(dim=-1)[greedy])
    assert ((got >= 0) & (got < 3001)).all() and torch.isfinite(x[[1, 3], got[[1, 3]]]).all()


# -- the decode vocab, every position of a tile, NaN ------------------------------------------

DECODE_V = 151936  # 37 tiles of 4096 and a last one of 384: ids past V sit in its masked lanes


def test_greedy_decode_vocab():
    """The real vocab at the default tile: the max in each lane of the last, partial tile, a tie
    between the first and the last tile, a row of all -inf."""
    V = DECODE_V
    x = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 4
    x[:, ::11] = NEG_INF
    x[0, 5] = x[0, V - 1] = 100.0
    for r, col in enumerate((V - 4, V - 3, V - 2, V - 1), start=1):
        x[r, col] = 100.0
    x[5] = NEG_INF
    x = x.to(DEVICE)
    got = gumbel_sample(x, torch.zeros(6, device=DEVICE), 1, 0)
    assert got.tolist() == [5, V - 4, V - 3, V - 2, V - 1, 0]
    assert torch.equal(got, x.argmax(dim=-1))


def test_sampled_ids_stay_in_the_vocab():
    """Rows whose only finite logits are the last columns of the last, partial tile (its masked
    lanes are next to them), and a flat row: every draw is a finite column below V."""
    V = DECODE_V
    x = torch.full((3, V), NEG_INF)
    x[0, V - 8:] = 0.0
    x[1, V - 3:] = torch.tensor([0.0, 1.0, 2.0])
    x[2] = 0.0
    x = x.to(DEVICE)
    inv = torch.tensor([1.0, 1 / 0.6, 1.0], device=DEVICE)
    for k in range(3):
        got = gumbel_sample(x, inv, 5, k * counters_used(3, V))
        assert ((got >= 0) & (got < V)).all() and torch.isfinite(x[torch.arange(3, device=DEVICE), got]).all()
        assert got[0] >= V - 8 and got[1] >= V - 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_finds_the_max_at_every_position(dtype):
    """Row r has its max at column r: every position of every tile, a partial last tile included.
    On a GPU at the default tile and warps, where an index that names the wrong element shows."""
    V, block = (300, 64) if INTERPRET else (8292, 4096)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(V, V, generator=g, device=DEVICE)
    x.fill_diagonal_(10.0)
    x = x.to(dtype)
    got = gumbel_sample(x, torch.zeros(V, device=DEVICE), 1, 0, block=block)
    assert torch.equal(got, torch.arange(V, device=DEVICE))
    if not INTERPRET:  # thousands of Philox programs: too slow for the interpreter
        cold = gumbel_sample(x, torch.full((V,), 1e4, device=DEVICE), 1, 0, block=block)
        assert torch.equal(cold, torch.arange(V, device=DEVICE))


def test_nan_logits_give_ids_inside_the_vocab():
    """NaN logits are not supported, but they must not produce an id outside the vocabulary: a NaN
    counts as +inf (ties to the lowest index, like any other)."""
    x = tricky_logits(5, 3000)
    x[0, 7] = float("nan")
    x[1] = float("nan")
    x[3, 2999] = float("nan")  # sampled: NaN after the scaling and the noise
    x[4, [100, 2000]] = float("inf")  # sampled: +inf ties to the lower index
    inv = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0], device=DEVICE)
    got = gumbel_sample(x, inv, 2, 0, block=1024)
    assert got.tolist() == [7, 0, x[2].argmax().item(), 2999, 100]


# Compiles the kernel for an H200 (sm_90) and prints the operands of every reduction. It runs in a
# fresh interpreter with the Triton interpreter off: a process that has run kernels under it
# cannot build for a real target (Triton 3.9 asserts in its own modules). Exit code 3: no NVIDIA
# backend in this Triton.
_COMPILE_SM90 = """
import json, re, sys
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepbatch.kernels.sample import _gumbel_max_kernel
if "nvidia" not in backends:
    sys.exit(3)
for dtype in ("fp32", "bf16"):
    sig = {"logits_ptr": f"*{dtype}", "inv_temp_ptr": "*fp32", "best_val_ptr": "*fp32", "best_idx_ptr": "*i64",
           "vocab": "i32", "stride_row": "i32", "seed": "i64", "offset": "i64", "BLOCK": "constexpr"}
    src = ASTSource(fn=_gumbel_max_kernel, signature=sig, constexprs={"BLOCK": 4096},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    ttir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ttir"]
    print(dtype, json.dumps(re.findall(r'"tt\\.reduce"\\(([^)]*)\\)', ttir)))
"""


def test_compiled_reductions_are_order_free():
    """The kernel as Triton builds it for an H200 (compiling needs no GPU). Triton lets a reshape
    that only feeds reductions reorder its elements: harmless for a max or a min, but an
    index-carrying reduction (``tl.max(..., return_indices=True)``) after it returns positions of
    the reordered tensor, not columns. So every reduction takes one operand; the indices come
    from a min over the columns that hold the max."""
    import json

    stdout = build_for_sm90(_COMPILE_SM90)
    lines = dict(line.split(" ", 1) for line in stdout.splitlines())
    for dtype in ("fp32", "bf16"):
        operands = json.loads(lines[dtype])
        assert operands and all("," not in ops for ops in operands), operands


# -- determinism ------------------------------------------------------------------------------


def test_draws_are_a_function_of_seed_and_offset():
    x = torch.zeros(5, 1000, device=DEVICE)  # flat: every draw is a fresh uniform pick
    inv = torch.ones(5, device=DEVICE)
    a = gumbel_sample(x, inv, 42, 2 ** 40)  # past 32 bits: the counter's high word is used
    assert torch.equal(a, gumbel_sample(x, inv, 42, 2 ** 40))
    assert not torch.equal(a, gumbel_sample(x, inv, 42, 2 ** 40 + counters_used(5, 1000)))
    assert not torch.equal(a, gumbel_sample(x, inv, 43, 2 ** 40))
    # The tiling does not move the draws: one element, one counter lane.
    assert torch.equal(a, gumbel_sample(x, inv, 42, 2 ** 40, block=64))


def test_empty_batch():
    got = gumbel_sample(torch.zeros(0, 100, device=DEVICE), torch.zeros(0, device=DEVICE), 0, 0)
    assert got.shape == (0,) and got.dtype == torch.int64


@pytest.mark.parametrize("case", ["1d", "int-dtype", "empty-vocab", "strided-last-dim", "inv-t-shape",
                                  "inv-t-dtype", "seed", "offset", "block"])
def test_bad_inputs_raise_value_error(case):
    x, inv, seed, offset, block = torch.zeros(4, 64), torch.zeros(4), 0, 0, 4096
    if case == "1d":
        x = torch.zeros(64)
    elif case == "int-dtype":
        x = x.int()
    elif case == "empty-vocab":
        x = torch.zeros(4, 0)
    elif case == "strided-last-dim":
        x = torch.zeros(64, 4).t()
    elif case == "inv-t-shape":
        inv = torch.zeros(4, 1)
    elif case == "inv-t-dtype":
        inv = torch.zeros(4, dtype=torch.float16)
    elif case == "seed":
        seed = -1
    elif case == "offset":
        offset = 2 ** 62
    elif case == "block":
        block = 96
    with pytest.raises(ValueError):
        gumbel_sample(x, inv, seed, offset, block=block)


# -- the sampler ------------------------------------------------------------------------------


def requests(*params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], p, max_tokens=8) for i, p in enumerate(params)]


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[3])  # the offset
        return gumbel_sample(*args, **kwargs)

    monkeypatch.setattr(sampler_mod, "gumbel_sample", counting)
    return calls


def test_sampler_on_cpu_keeps_the_torch_path(kernel_calls):
    sampler = Sampler(1000, "cpu")
    logits = torch.randn(3, 1000)
    sampler.sample(logits, requests(SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1.0))).resolve()
    assert kernel_calls == []


def test_sampler_forced_kernel(kernel_calls):
    vocab = 1000
    sampler = Sampler(vocab, DEVICE, fused=True)
    logits = tricky_logits(5, vocab)
    batch = requests(SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                     SamplingParams(temperature=0.0, seed=3), SamplingParams(temperature=1.0, top_k=vocab),
                     SamplingParams(temperature=0.0, top_p=0.5))
    first = sampler.sample(logits, batch)
    ids = first.resolve().token_ids
    assert kernel_calls == [0]
    assert [ids[i] for i in (0, 2, 4)] == logits.argmax(dim=-1)[[0, 2, 4]].tolist()
    assert all(0 <= ids[i] < vocab and torch.isfinite(logits[i, ids[i]]) for i in (1, 3))
    # The next call draws from fresh counters.
    sampler.sample(logits, batch).resolve()
    assert kernel_calls == [0, counters_used(5, vocab)]


@pytest.mark.parametrize("params", [dict(top_k=50), dict(top_p=0.9), dict(min_p=0.1), dict(seed=7)],
                         ids=["top-k", "top-p", "min-p", "seed"])
def test_sampler_sends_filtered_rows_to_the_rejection_kernel(kernel_calls, monkeypatch, params):
    filtered = []

    def counting(*args, **kwargs):
        filtered.append(args[0].shape[0])
        return sample_rejection(*args, **kwargs)

    monkeypatch.setattr(sampler_mod, "sample_rejection", counting)
    sampler = Sampler(1000, DEVICE, fused=True)
    batch = requests(SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, **params),
                     SamplingParams(temperature=0.0))
    logits = torch.randn(3, 1000, device=DEVICE)
    ids = sampler.sample(logits, batch).resolve().token_ids
    assert kernel_calls == [] and filtered == [3] and all(0 <= t < 1000 for t in ids)
    assert ids[2] == logits[2].argmax().item()


# -- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_shape(dtype):
    S, V = 256, 151936
    torch.manual_seed(0)
    x = (torch.randn(S, V, device="cuda") * 4).to(dtype)
    x[:, ::11] = NEG_INF
    x[0, 5] = x[0, V - 1] = 100.0
    greedy = gumbel_sample(x, torch.zeros(S, device="cuda"), 1, 0)
    assert torch.equal(greedy, x.argmax(dim=-1))
    inv = torch.where(torch.arange(S, device="cuda") % 2 == 0, 0.0, 1 / 0.6)
    mixed = gumbel_sample(x, inv, 1, 0)
    assert torch.equal(mixed[::2], x.argmax(dim=-1)[::2])
    assert ((mixed >= 0) & (mixed < V)).all() and torch.isfinite(x[torch.arange(S, device="cuda"), mixed].float()).all()
    assert torch.equal(mixed, gumbel_sample(x, inv, 1, 0))


def test_engine_uses_the_kernel_by_default_on_gpus_only(tiny_checkpoints):
    from deepbatch import LLM

    off = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", fused_sampler=False)
    assert off.engine.runner.sampler.fused is False
    on = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu")
    # The default: used on a GPU with Triton; on the CPU the torch path stays.
    assert on.engine.runner.sampler.fused is None
    assert not on.engine.runner.sampler._fused_enabled(torch.zeros(1, 8))
