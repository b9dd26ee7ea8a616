"""The penalties kernel held to ``apply_penalties_ref``, on the CPU through the Triton interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest

pytest.importorskip("triton")

from deepbatch.kernels.apply_penalties import apply_penalties, apply_penalties_ref  # noqa: E402


def state(slots: int, vocab: int, gen: torch.Generator):
    counts = torch.randint(0, 4, (slots, vocab), generator=gen, dtype=torch.int32)
    counts[torch.rand(slots, vocab, generator=gen) < 0.7] = 0  # most tokens unseen
    mask = torch.rand(slots, vocab, generator=gen) < 0.1
    return counts.to(DEVICE), mask.to(DEVICE)


def case(S: int, V: int, rows: list[int], slots: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(S, V, generator=gen) * 4).to(DEVICE)
    logits[:, 3] = float("-inf")  # a banned token stays banned
    counts, mask = state(max(slots) + 2, V, gen)
    P = len(rows)
    rep = torch.tensor([1.3, 0.8, 1.0, 1.7][:P] * (P // 4 + 1))[:P].to(DEVICE)
    freq = torch.linspace(-0.5, 1.5, P).to(DEVICE)
    pres = torch.linspace(1.0, -1.0, P).to(DEVICE)
    idx = [torch.tensor(x, dtype=torch.int64, device=DEVICE) for x in (rows, slots)]
    return logits, idx[0], idx[1], counts, mask, rep, freq, pres


@pytest.mark.parametrize("S,V,rows,slots", [
    (4, 300, [0, 1, 2, 3], [5, 0, 2, 1]),  # every row, slots out of order
    (6, 5000, [4, 1], [0, 3]),  # some rows, tiles beyond one block
    (1, 7, [0], [0]),  # a vocab smaller than a block
], ids=["whole", "some-rows", "tiny"])
def test_matches_reference(S, V, rows, slots):
    logits, r, s, counts, mask, rep, freq, pres = case(S, V, rows, slots)
    raw = logits.clone()
    out = logits.clone()
    apply_penalties(logits, out, r, s, counts, mask, rep, freq, pres)
    ref = apply_penalties_ref(raw, r, s, counts, mask, rep, freq, pres)
    torch.testing.assert_close(out[r], ref, rtol=1e-6, atol=1e-6)
    untouched = [i for i in range(S) if i not in rows]
    assert torch.equal(out[untouched], raw[untouched]) and torch.equal(logits, raw)
    assert torch.isneginf(out[r][:, 3]).all()


def test_in_place():
    logits, r, s, counts, mask, rep, freq, pres = case(3, 700, [2, 0], [1, 0], seed=1)
    ref = apply_penalties_ref(logits, r, s, counts, mask, rep, freq, pres)
    assert apply_penalties(logits, logits, r, s, counts, mask, rep, freq, pres) is logits
    torch.testing.assert_close(logits[r], ref, rtol=1e-6, atol=1e-6)


def test_reference_is_the_formula():
    """One token of each kind, by hand: unseen, prompt-only, sampled twice (positive and negative)."""
    logits = torch.tensor([[2.0, 2.0, 2.0, -2.0]])
    counts = torch.tensor([[0, 0, 2, 2]], dtype=torch.int32)
    mask = torch.tensor([[False, True, False, False]])
    one = torch.tensor([0])
    got = apply_penalties_ref(logits, one, one, counts, mask, torch.tensor([2.0]), torch.tensor([0.5]),
                              torch.tensor([0.25]))
    assert got.tolist() == [[2.0, 1.0, 1.0 - 1.0 - 0.25, -4.0 - 1.0 - 0.25]]


@pytest.mark.parametrize("bad", ["bf16-logits", "out-shape", "counts-dtype", "mask-shape", "rows-dtype", "rep-len"])
def test_bad_inputs_raise_value_error(bad):
    logits, r, s, counts, mask, rep, freq, pres = case(2, 64, [0, 1], [0, 1])
    out = logits.clone()
    if bad == "bf16-logits":
        logits = logits.bfloat16()
    elif bad == "out-shape":
        out = out[:1]
    elif bad == "counts-dtype":
        counts = counts.long()
    elif bad == "mask-shape":
        mask = mask[:, :10]
    elif bad == "rows-dtype":
        r = r.int()
    elif bad == "rep-len":
        rep = rep[:1]
    with pytest.raises(ValueError, match="apply_penalties"):
        apply_penalties(logits, out, r, s, counts, mask, rep, freq, pres)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_shape():
    S, V = 256, 151936
    rows = list(range(S))
    slots = list(range(S - 1, -1, -1))
    logits, r, s, counts, mask, rep, freq, pres = case(S, V, rows, slots, seed=2)
    ref = apply_penalties_ref(logits, r, s, counts, mask, rep, freq, pres)
    out = apply_penalties(logits, torch.empty_like(logits), r, s, counts, mask, rep, freq, pres)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
