"""The sort-free top-k / top-p / min-p sampling kernel against its sorting torch reference: the
same kept set on crafted rows (ties, every switch off, -inf, min-p, temperatures), the same ids
(the reference reproduces the Philox uniforms), draws that follow the truncated renormalised
distribution, seeded rows that ignore the batch around them, greedy rows that are the argmax.
On the CPU through the Triton interpreter, where one row costs tens of milliseconds."""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest  # noqa: E402

pytest.importorskip("triton")

from sm90_build import build_for_sm90  # noqa: E402
from deepbatch.kernels.sample import counters_used, gumbel_sample  # noqa: E402
from deepbatch.kernels.philox_ref import philox4x32_ref  # noqa: E402
from deepbatch.kernels.sample_top_k_top_p import (  # noqa: E402
    kept_set_ref,
    sample_top_k_top_p,
    sample_top_k_top_p_ref,
    seed_as_int64,
)

NEG_INF = float("-inf")


def batch(rows, vocab=None, dtype=torch.float32):
    """Tensors for the kernel from ``rows``: dicts with ``logits`` (a list, padded with -30 up to
    ``vocab``) and optional ``T``, ``k``, ``p``, ``min_p``, ``seed``, ``pos``."""
    V = vocab or max(len(r["logits"]) for r in rows)
    x = torch.full((len(rows), V), -30.0)
    for i, r in enumerate(rows):
        x[i, : len(r["logits"])] = torch.tensor(r["logits"], dtype=torch.float32)
    col = lambda name, default, dt: torch.tensor([r.get(name, default) for r in rows], dtype=dt, device=DEVICE)  # noqa: E731
    seeded = torch.tensor([r.get("seed") is not None for r in rows], device=DEVICE)
    return (x.to(dtype).to(DEVICE), col("T", 1.0, torch.float32), col("k", -1, torch.int32),
            col("p", 1.0, torch.float32), col("min_p", 0.0, torch.float32),
            torch.tensor([seed_as_int64(r.get("seed") or 0) for r in rows], dtype=torch.int64, device=DEVICE),
            col("pos", 0, torch.int64), seeded)


def kept_ids(kept_row):
    return kept_row.nonzero().flatten().tolist()


# -- the kept set -------------------------------------------------------------------------------

# Each row with the kept set worked out by hand. Logits past the list are -30 (far out of every
# set below, never kept by any cut that keeps less than the whole vocab).
LN = math.log
CRAFTED = [
    # top-k: ties at the k-th value are all kept
    (dict(logits=[5, 4, 3, 3, 3, 2, 1], k=3), [0, 1, 2, 3, 4]),
    (dict(logits=[5, 4, 3, 3, 3, 2, 1], k=5), [0, 1, 2, 3, 4]),
    (dict(logits=[5, 4, 3, 3, 3, 2, 1], k=6), [0, 1, 2, 3, 4, 5]),
    # k = 1, also with a tie at the max; k >= V and k = -1 are off
    (dict(logits=[1, 7, 2, 7, 0], k=1), [1, 3]),
    (dict(logits=[1, 9, 2, 3, 0], k=1, T=3.0), [1]),
    (dict(logits=[0.0] * 8, k=40), list(range(40))),
    (dict(logits=[0.0] * 8, k=-1), list(range(40))),
    # top-p: the smallest head whose mass reaches p; p = 1 keeps all, p tiny keeps the max
    (dict(logits=[LN(0.5), LN(0.3), LN(0.15), LN(0.05)], p=0.7, k=4), [0, 1]),
    (dict(logits=[LN(0.5), LN(0.3), LN(0.15), LN(0.05)], p=0.85, k=4), [0, 1, 2]),
    (dict(logits=[LN(0.5), LN(0.3), LN(0.15), LN(0.05)], p=0.9, k=4), [0, 1, 2]),
    (dict(logits=[LN(0.5), LN(0.3), LN(0.15), LN(0.05)], p=0.96, k=4), [0, 1, 2, 3]),
    (dict(logits=[LN(0.5), LN(0.3), LN(0.15), LN(0.05)], p=1.0, k=4), [0, 1, 2, 3]),
    (dict(logits=[3, 1, 2, 0], p=1e-6), [0]),
    # a tie that straddles p: the whole tie group stays
    (dict(logits=[LN(0.4), LN(0.2), LN(0.2), LN(0.2)], p=0.5, k=4), [0, 1, 2, 3]),
    (dict(logits=[LN(0.4), LN(0.2), LN(0.2), LN(0.2)], p=0.3, k=4), [0]),
    # top-p is over the top-k set renormalised: k=2 leaves (0.625, 0.375), so p = 0.6 keeps one
    # (over the full row, 0.5 < 0.6 would keep two)
    (dict(logits=[LN(0.5), LN(0.3), LN(0.15), LN(0.05)], k=2, p=0.6), [0]),
    # all the mass on one token
    (dict(logits=[0, 0, 60, 0, 0], p=0.999), [2]),
    (dict(logits=[0, 0, 60, 0, 0], k=3, p=0.999, T=0.1), [2]),
    # -inf logits: never kept, even when k reaches past the finite ones
    (dict(logits=[NEG_INF, 2, NEG_INF, 1, 0] + [NEG_INF] * 35, k=10), [1, 3, 4]),
    (dict(logits=[NEG_INF, 2, NEG_INF, 1, 0] + [NEG_INF] * 35, p=0.999999), [1, 3, 4]),
    # min-p: p_v >= min_p * p_max, i.e. x_v >= x_max + log(min_p); it applies after top-p (the
    # torch path's order), so top-p's mass still counts the tokens min-p drops
    (dict(logits=[LN(0.4), LN(0.3), LN(0.2), LN(0.1)], k=4, min_p=0.6), [0, 1]),
    (dict(logits=[LN(0.4), LN(0.3), LN(0.2), LN(0.1)], k=4, min_p=0.6, p=0.5), [0, 1]),
    (dict(logits=[LN(0.4), LN(0.3), LN(0.2), LN(0.1)], k=4, min_p=0.45, p=0.95), [0, 1, 2]),
    (dict(logits=[LN(0.4), LN(0.3), LN(0.2), LN(0.1)], k=3, min_p=0.2), [0, 1, 2]),
    (dict(logits=[2, 2, 1, 0], min_p=1.0, k=4), [0, 1]),
    # temperature moves the cuts: logits (2, 1, 0, -1) at T = 0.5 are p = (0.865, 0.117, ...);
    # at T = 4, (0.35, 0.27, 0.21, 0.16) and p / p_max = (1, 0.78, 0.61, 0.47); at T = 0.25,
    # p / p_max = (1, 0.018, ...)
    (dict(logits=[2, 1, 0, -1], T=0.5, p=0.8, k=4), [0]),
    (dict(logits=[2, 1, 0, -1], T=4.0, p=0.5, k=4), [0, 1]),
    (dict(logits=[2, 1, 0, -1], T=4.0, min_p=0.5), [0, 1, 2]),
    (dict(logits=[2, 1, 0, -1], T=0.25, min_p=0.01), [0, 1]),
    (dict(logits=[2, 1, 0, -1], T=0.25, min_p=0.02), [0]),
]


@pytest.mark.parametrize("block,max_candidates", [(16, 0), (1024, 2048)], ids=["tiles-streamed", "compacted"])
def test_crafted_kept_sets(block, max_candidates):
    """Every crafted row in one batch of V = 40: the kernel's kept set is the one worked out by
    hand and the sorting reference's, whether the search reads the row every pass or compacts
    its candidates."""
    rows = [r for r, _ in CRAFTED]
    args = batch(rows, vocab=40)
    ids, kept = sample_top_k_top_p(*args, 7, 0, block=block, max_candidates=max_candidates, return_kept=True)
    ref_ids, ref_kept = sample_top_k_top_p_ref(*args, 7, 0, return_kept=True)
    for i, (row, expected) in enumerate(CRAFTED):
        assert kept_ids(kept[i].cpu()) == expected, (i, row)
        assert kept_ids(ref_kept[i].cpu()) == expected, (i, row)
        assert ids[i].item() in expected
    assert torch.equal(ids, ref_ids)


def random_rows(S, V, seed, dtype=torch.float32):
    """Rows of random logits with random switches: greedy, seeded, ties, -inf, every cut."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, V, generator=g) * torch.rand(S, 1, generator=g).mul(4).add(0.5)
    x[:, ::11] = NEG_INF
    x[1, 5:25] = x[1, 5]  # a wide tie
    x[2, :] = x[2, :].round()  # many ties
    T = torch.rand(S, generator=g) * 1.5 + 0.2
    T[0] = 0.0
    k = torch.randint(1, V + 20, (S,), generator=g, dtype=torch.int32)
    k[torch.rand(S, generator=g) < 0.3] = -1
    p = torch.where(torch.rand(S, generator=g) < 0.3, 1.0, torch.rand(S, generator=g) * 0.99 + 0.01)
    min_p = torch.where(torch.rand(S, generator=g) < 0.5, 0.0, torch.rand(S, generator=g) * 0.3)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (S,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2 ** 40, (S,), generator=g, dtype=torch.int64)
    seeded = torch.rand(S, generator=g) < 0.5
    return tuple(t.to(DEVICE) for t in (x.to(dtype), T, k, p, min_p, seeds, positions, seeded))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_rows_match_the_reference(dtype):
    """Random parameters over a vocab of several tiles: the same kept set and the same ids."""
    args = random_rows(16, 300, seed=3, dtype=dtype)
    ids, kept = sample_top_k_top_p(*args, 99, 2 ** 33, block=64, return_kept=True)
    ref_ids, ref_kept = sample_top_k_top_p_ref(*args, 99, 2 ** 33, return_kept=True)
    assert torch.equal(kept, ref_kept)
    assert torch.equal(ids, ref_ids)
    assert kept[1:].any(dim=1).all() and not kept[0].any()


def test_reference_kept_set_is_the_sorted_definition():
    """The reference's top-p against a plain loop over the sorted tokens (the definition)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 50, generator=g) * 2).round(decimals=1)  # rounding makes ties
    k = torch.tensor([-1, 5, 10, 50, 3, 20], dtype=torch.int32)
    p = torch.tensor([0.5, 0.9, 0.3, 0.99, 1.0, 0.7])
    kept = kept_set_ref(x, k, p, torch.zeros(6))
    for i in range(6):
        probs = torch.softmax(x[i].double(), 0)
        order = sorted(range(50), key=lambda v: -x[i, v].item())
        kth = x[i, order[k[i] - 1]].item() if 0 < k[i] < 50 else NEG_INF
        head = [v for v in order if x[i, v] >= kth]
        z = sum(probs[v].item() for v in head)
        expected = {v for v in head if sum(probs[w].item() for w in head if x[i, w] > x[i, v]) < p[i].item() * z
                    or p[i] >= 1}
        assert set(kept_ids(kept[i])) == expected, i


# -- draws --------------------------------------------------------------------------------------

# Eight logits where each cut drops something: k = 6, p = 0.95 and min_p = 0.15 at T = 0.8 leave
# tokens 0-3 (worked out in test_draw_row_kept_set).
DRAW_ROW = [2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0]
DRAW = dict(logits=DRAW_ROW, T=0.8, k=6, p=0.95, min_p=0.15)
KEPT = [0, 1, 2, 3]


def truncated(logits, temperature, kept):
    q = torch.zeros(len(logits), dtype=torch.float64)
    w = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, 0)
    q[kept] = w[kept] / w[kept].sum()
    return q


def chi2_stat(counts, q):
    expected = q * counts.sum()
    support = q > 0
    assert counts[~support].sum() == 0, "drew a token outside the kept set"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def chi2_crit(dof, alpha=1e-4):
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1 - alpha, dof))
    except ImportError:  # Wilson-Hilferty, within a percent here
        z = 3.719  # the 1 - 1e-4 normal quantile
        return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_draw_row_kept_set():
    """DRAW by hand: T = 0.8 gives p = (.442 .236 .127 .077 .053 .036 .019 .010); k = 6 drops the
    last two and renormalises to (.455 .244 .130 .079 .054 .037); p = 0.95 drops the sixth (the
    mass before it, .963, reaches .95; before the fifth, .908, does not); min_p = 0.15 drops the
    fifth (p / p_max = .119; the fourth has .174)."""
    args = batch([DRAW])
    _, kept = sample_top_k_top_p(*args, 0, 0, return_kept=True)
    assert kept_ids(kept[0].cpu()) == KEPT


def test_draws_follow_the_truncated_distribution():
    """150 kernel draws of DRAW (each row of a batch draws from its own counters) against the
    truncated renormalised distribution. The same counts fail against the row at half the
    temperature or renormalised uniformly over the kept set (both expected near 40, against a
    critical value of 21); a draw of a dropped token (the untruncated row would draw one every
    10 or so) fails outright."""
    n = 150
    args = batch([DRAW] * n)
    ids = sample_top_k_top_p(*args, 2024, 0, block=16).cpu()
    counts = torch.bincount(ids, minlength=len(DRAW_ROW)).double()
    crit = chi2_crit(len(KEPT) - 1)
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.8, KEPT)) < crit
    uniform = torch.zeros(len(DRAW_ROW), dtype=torch.float64)
    uniform[KEPT] = 1 / len(KEPT)
    for wrong in (truncated(DRAW_ROW, 0.4, KEPT), uniform):
        assert chi2_stat(counts, wrong) > crit


def test_reference_draws_follow_the_truncated_distribution():
    """The reference (whose ids the kernel matches) over 20000 draws: a sharp check of the
    Philox uniforms and of the Gumbel-max over the kept logits."""
    n = 20000
    args = batch([DRAW] * n)
    ids = sample_top_k_top_p_ref(*args, 77, 12345)
    counts = torch.bincount(ids.cpu(), minlength=len(DRAW_ROW)).double()
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.8, KEPT)) < chi2_crit(len(KEPT) - 1)
    assert chi2_stat(counts, truncated(DRAW_ROW, 0.9, KEPT)) > chi2_crit(len(KEPT) - 1)


def test_unfiltered_rows_draw_what_gumbel_sample_draws():
    """With every cut off, unseeded rows take the counters of kernels/sample.py: the same ids."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 200, generator=g) * 2).to(DEVICE)
    T = torch.tensor([1.0, 0.5, 2.0, 0.0, 0.9, 1.3], device=DEVICE)
    rows = [dict(logits=r.tolist(), T=t) for r, t in zip(x.cpu(), T.tolist(), strict=True)]
    args = batch(rows)
    offset = 3 * counters_used(6, 200) + 2 ** 32
    ids = sample_top_k_top_p(*args, 31, offset, block=64)
    inv_t = torch.where(T > 0, 1.0 / torch.where(T > 0, T, 1.0), 0.0)
    assert torch.equal(ids, gumbel_sample(x, inv_t, 31, offset, block=64))


def test_philox_reference_known_answer():
    """Philox4x32-10 against the Random123 known-answer vectors (counter and key all ones, and
    the digits of pi), which pin down the round constants and the word order."""
    zeros = philox4x32_ref(torch.tensor(0), *[torch.tensor(0)] * 4)
    assert [int(w) for w in zeros] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox4x32_ref(torch.tensor(-1), *[torch.tensor(0xFFFFFFFF)] * 4)
    assert [int(w) for w in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    key = torch.tensor(0x299F31D0_A4093822)  # key words (0xA4093822, 0x299F31D0)
    pi = philox4x32_ref(key, *[torch.tensor(c) for c in (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)])
    assert [int(w) for w in pi] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_launch_settings_do_not_change_anything():
    """Tiles, boundaries per pass and the candidate buffer (none, too small for some rows, room
    for every row) change the passes, not the kept sets or the draws."""
    args = random_rows(4, 200, seed=8)
    a = sample_top_k_top_p(*args, 5, 0, block=32, num_boundaries=4, max_candidates=0, return_kept=True)
    for block, nb, cap in ((512, 32, 2048), (64, 8, 24)):
        b = sample_top_k_top_p(*args, 5, 0, block=block, num_boundaries=nb, max_candidates=cap, return_kept=True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# -- seeded rows --------------------------------------------------------------------------------

FLAT = [0.1 * (v % 7) for v in range(64)]  # near-uniform: a draw is a fresh pick among many


def test_seeded_rows_ignore_the_batch():
    """The same (seed, position) row at different row indices, beside different neighbours, under
    different batch seeds and offsets, gives the same token; unseeded rows do not."""
    me = dict(logits=FLAT, T=1.0, k=50, p=0.95, seed=2 ** 64 - 3, pos=17)
    other = dict(logits=FLAT[::-1], T=0.7, p=0.5)
    layouts = [([me, other, other], 0, 1, 0), ([other, other, other, me], 3, 2, 10 ** 6),
               ([other, me], 1, 3, 2 ** 40), ([me], 0, 4, 0)]
    got = []
    for rows, at, philox_seed, offset in layouts:
        ids = sample_top_k_top_p(*batch(rows), philox_seed, offset, block=16)
        got.append(ids[at].item())
    assert len(set(got)) == 1
    # The same row unseeded moves with the batch seed; the seeded one moves with its position
    # and its seed.
    unseeded = {sample_top_k_top_p(*batch([dict(me, seed=None)]), s, 0, block=16).item() for s in range(4)}
    positions = {sample_top_k_top_p(*batch([dict(me, pos=q)]), 0, 0, block=16).item() for q in range(4)}
    seeds = {sample_top_k_top_p(*batch([dict(me, seed=q)]), 0, 0, block=16).item() for q in range(4)}
    assert len(unseeded) > 1 and len(positions) > 1 and len(seeds) > 1


def test_seed_words_are_all_used():
    """Seeds that differ only in their high 32 bits, and positions past 2**32, are other streams:
    eight positions of each variant draw other sequences, and the kernel's are the reference's."""
    variants = [dict(seed=5, pos=0), dict(seed=5 + 2 ** 40, pos=0), dict(seed=5 + 2 ** 63, pos=0),
                dict(seed=5, pos=2 ** 33)]
    rows = [dict(logits=FLAT, seed=v["seed"], pos=v["pos"] + q) for v in variants for q in range(8)]
    args = batch(rows)
    ids = sample_top_k_top_p(*args, 0, 0)
    assert torch.equal(ids, sample_top_k_top_p_ref(*args, 0, 0))
    sequences = [tuple(ids[8 * i: 8 * i + 8].tolist()) for i in range(4)]
    assert len(set(sequences)) == 4


# -- greedy rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_rows_are_the_exact_argmax(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 700, generator=g)
    x[0, 3] = x[0, 650] = 9.0  # a tie across tiles: the lower index
    x[1, 10] = x[1, 11] = 9.0  # a tie inside a tile
    x[2] = NEG_INF  # all -inf: index 0, as torch.argmax
    x[3, ::3] = NEG_INF
    x[3, 699] = 8.0
    x[4, 123] = float("nan")  # NaN counts as the max (torch.argmax's answer)
    x = x.to(dtype).to(DEVICE)
    # cuts and seeds on greedy rows change nothing
    args = (x, torch.zeros(5, device=DEVICE), torch.full((5,), 2, dtype=torch.int32, device=DEVICE),
            torch.full((5,), 0.1, device=DEVICE), torch.full((5,), 0.5, device=DEVICE),
            torch.arange(5, device=DEVICE), torch.arange(5, device=DEVICE), torch.ones(5, dtype=torch.bool, device=DEVICE))
    ids = sample_top_k_top_p(*args, 0, 0, block=256)
    assert ids.tolist() == [3, 10, 0, 699, 123]
    assert torch.equal(ids, x.argmax(dim=-1))
    assert torch.equal(ids, sample_top_k_top_p_ref(*args, 0, 0))


def test_mixed_batch_greedy_rows_untouched():
    args = random_rows(8, 200, seed=4)
    x, T = args[0], args[1].clone()
    T[::2] = 0.0
    ids = sample_top_k_top_p(x, T, *args[2:], 3, 0, block=64)
    assert torch.equal(ids[::2], x[::2].argmax(dim=-1))
    assert torch.equal(ids, sample_top_k_top_p_ref(x, T, *args[2:], 3, 0))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf - inf
def test_nan_and_inf_in_sampled_rows_stay_in_the_vocab():
    """NaN logits are not supported (the sampler ends such requests), but give an id inside the
    vocab: a NaN is never drawn in a sampled row; +inf logits win."""
    x = torch.randn(4, 100)
    x[0, 7] = float("nan")
    x[1] = float("nan")
    x[2, 40] = float("inf")
    x[3, [10, 60]] = float("inf")
    rows = [dict(logits=r.tolist(), k=5, p=0.9) for r in x]
    ids = sample_top_k_top_p(*batch(rows), 0, 0, block=32).tolist()
    assert ids[0] != 7 and 0 <= ids[1] < 100 and ids[2] == 40 and ids[3] in (10, 60)


# -- errors -------------------------------------------------------------------------------------


def test_empty_batch():
    args = batch([dict(logits=[0.0] * 8)])
    ids = sample_top_k_top_p(*(a[:0] for a in args), 0, 0)
    assert ids.shape == (0,) and ids.dtype == torch.int64


@pytest.mark.parametrize("case", ["1d", "int-logits", "empty-vocab", "strided", "temp-dtype", "top-k-dtype",
                                  "seeded-dtype", "shape", "philox-seed", "offset", "block", "boundaries",
                                  "candidates"])
def test_bad_inputs_raise_value_error(case):
    args = list(batch([dict(logits=[0.0] * 8)] * 2))
    kwargs = {}
    philox = [0, 0]
    if case == "1d":
        args[0] = args[0][0]
    elif case == "int-logits":
        args[0] = args[0].int()
    elif case == "empty-vocab":
        args[0] = args[0][:, :0]
    elif case == "strided":
        args[0] = torch.zeros(8, 2, device=DEVICE).t()
    elif case == "temp-dtype":
        args[1] = args[1].double()
    elif case == "top-k-dtype":
        args[2] = args[2].long()
    elif case == "seeded-dtype":
        args[7] = args[7].int()
    elif case == "shape":
        args[3] = args[3][:1]
    elif case == "philox-seed":
        philox[0] = -1
    elif case == "offset":
        philox[1] = 2 ** 62
    elif case == "block":
        kwargs["block"] = 24
    elif case == "boundaries":
        kwargs["num_boundaries"] = 6
    elif case == "candidates":
        kwargs["max_candidates"] = -1
    with pytest.raises(ValueError):
        sample_top_k_top_p(*args, *philox, **kwargs)


# -- compiled for an H200 -----------------------------------------------------------------------

# Builds the kernel for sm_90 (no GPU needed) in a fresh interpreter with the Triton interpreter
# off: a process that has run kernels under it cannot build for a real target. Exit code 3: no
# NVIDIA backend in this Triton.
_COMPILE_SM90 = """
import sys
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepbatch.kernels.sample_top_k_top_p import _sample_top_k_top_p_kernel
if "nvidia" not in backends:
    sys.exit(3)
ptrs = ["temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seed_ptr", "pos_ptr", "seeded_ptr", "tile_max_ptr",
        "cand_key_ptr", "cand_col_ptr", "out_ptr", "kept_ptr", "skip_ptr"]
types = ["*fp32", "*i32", "*fp32", "*fp32", "*i64", "*i64", "*i1", "*i32", "*i32", "*i32", "*i64", "*i1", "*i1"]
for dtype, write_kept in (("bf16", True),):  # kept stores on: every line of the kernel
    sig = {"logits_ptr": f"*{dtype}", **dict(zip(ptrs, types)), "vocab": "i32", "stride_row": "i32",
           "philox_seed": "i64", "philox_offset": "i64"}
    consts = {"BLOCK": 1024, "SUB": 256, "NB": 16, "CAP": 2048, "WRITE_KEPT": write_kept, "SKIP": True}
    sig.update({name: "constexpr" for name in consts})
    src = ASTSource(fn=_sample_top_k_top_p_kernel, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(14)})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    print(dtype, "ok")
"""


def test_compiles_for_sm90():
    """The interpreter runs the kernel as Python; this builds it as an H200 would, so a construct
    the compiler rejects (a loop-carried value that changes type, a scan it cannot lower) fails
    here on the CPU too."""
    stdout = build_for_sm90(_COMPILE_SM90)
    assert stdout.split() == ["bf16", "ok"]


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_large_vocab_matches_the_reference(dtype):
    """bf16 logits of the 152k vocab at the default tile, compiled: the same kept set and ids as
    the reference for nearly every row (exp and log may differ in the last ulp on the GPU, which
    can move a token that sits exactly on a cut)."""
    g = torch.Generator().manual_seed(11)
    S, V = 64, 151936
    args = list(random_rows(S, V, seed=12, dtype=dtype))
    args[0] = (torch.randn(S, V, generator=g) * 3).to(dtype).to(DEVICE)
    ids, kept = sample_top_k_top_p(*args, 9, 0, return_kept=True)
    ref_ids, ref_kept = sample_top_k_top_p_ref(*args, 9, 0, return_kept=True)
    assert (kept != ref_kept).sum().item() <= 2
    assert (ids == ref_ids).float().mean().item() >= 62 / 64
