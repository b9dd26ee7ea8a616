"""Seeded sampling: the counter-based noise against a plain-Python reference, the full 64-bit
seed range, and per-choice streams for n > 1."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepbatch import LLM, InvalidRequestError, SamplingParams
from deepbatch.sampling.seeded_noise import mix32, seeded_exponential

M = 0xFFFFFFFF


def mix32_reference(x: int) -> int:
    """The same mixer on Python's unbounded ints: the reference for the split int64 products."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def noise_reference(seed: int, choice: int, step: int, vocab: int) -> list[float]:
    out = []
    for v in range(vocab):
        h = v
        for word in (seed & M, seed >> 32, choice & M, step & M):
            h = mix32_reference(h ^ word)
        out.append(-math.log((h + 0.5) / 2**32))
    return out


def test_mix32_matches_reference_over_the_whole_range():
    rng = random.Random(0)
    xs = [0, 1, M, M - 1, 2**31, 2**31 - 1, 0x7FEB352D] + [rng.randrange(2**32) for _ in range(5000)]
    got = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32_reference(x) for x in xs]
    assert all(0 <= g <= M for g in got)


def test_mix32_is_a_bijection_on_a_block():
    # A bijection maps 2**16 distinct inputs to 2**16 distinct outputs.
    out = mix32(torch.arange(2**16, dtype=torch.int64) * 65_537)
    assert out.unique().numel() == 2**16


@pytest.mark.parametrize("seed", [0, 1, 2**32, 2**62, 2**64 - 1])
def test_noise_matches_reference(seed):
    got = seeded_exponential([(seed, 3, 17)], 64, torch.device("cpu"))[0].tolist()
    ref = noise_reference(seed, 3, 17, 64)
    assert got == pytest.approx(ref, rel=1e-6)


def test_noise_is_exponential():
    q = seeded_exponential([(12345, 0, t) for t in range(8)], 50_000, torch.device("cpu")).double()
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e; 400k draws put these within a few 1e-3.
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.02
    assert abs((q > 1).double().mean().item() - math.exp(-1)) < 0.005


def test_seeds_that_collided_modulo_2_32_differ():
    rows = seeded_exponential([(0, 0, 0), (2**32, 0, 0), (2**62, 0, 0), (0, 1, 0), (1, 0, 0), (0, 0, 1)],
                              4096, torch.device("cpu"))
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert not torch.equal(rows[i], rows[j]), (i, j)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_is_the_same_on_the_gpu():
    keys = [(2**63 + 5, 1, 9), (7, 0, 0)]
    cpu = seeded_exponential(keys, 151_936, torch.device("cpu"))
    gpu = seeded_exponential(keys, 151_936, torch.device("cuda")).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=0)


# -- end to end ----------------------------------------------------------------------------------

PROMPT = {"prompt_token_ids": [11, 12, 13, 14, 15, 16]}


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=128)


def _sample(llm, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, **kwargs)
    return [o.token_ids for o in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]


@pytest.mark.parametrize("seed", [2**64, -1, 2**70])
def test_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(seed=seed)
    assert e.value.param == "seed"


def test_seed_must_be_an_int():
    for seed in (True, 1.0, "1"):
        with pytest.raises(InvalidRequestError):
            SamplingParams(seed=seed)


def test_full_64_bit_seeds_give_distinct_samples(llm):
    samples = [tuple(_sample(llm, seed=s)[0]) for s in (0, 2**32, 2**62, 2**64 - 1)]
    assert len(set(samples)) == len(samples)
    assert _sample(llm, seed=2**64 - 1) == [list(samples[-1])]  # and each still reproduces


def test_choices_are_keyed_by_index_not_by_seed_plus_index(llm):
    pair = _sample(llm, seed=42, n=2)
    assert pair[0] != pair[1]
    assert pair[1] != _sample(llm, seed=43)[0]
    assert pair[0] == _sample(llm, seed=42)[0]  # choice 0 of n=2 is the n=1 stream
