"""Seeded sampling: the Philox noise against the kernels' own uniforms, the full 64-bit seed
range, per-choice streams for n > 1, and a seeded row sampled alike by the torch path and the
sampling kernel (on the CPU through the Triton interpreter)."""

from __future__ import annotations

import math

import pytest
import torch

from deepbatch import LLM, InvalidRequestError, SamplingParams
from deepbatch.kernels.sample_top_k_top_p import SEEDED_TAG, philox4x32_ref, seed_as_int64, uniform_ref
from deepbatch.sampling.seeded_noise import seeded_exponential, stream_position


def noise_reference(seed: int, choice: int, step: int, vocab: int) -> list[float]:
    """Word by word: Philox keyed by the seed at counter (v // 4, step, choice, tag), lane v % 4."""
    out = []
    key = torch.tensor([seed_as_int64(seed)])
    for v in range(vocab):
        words = [torch.tensor([w]) for w in (v // 4, step, choice, SEEDED_TAG)]
        lane = philox4x32_ref(key, *words)[v % 4]
        u = uniform_ref(lane).item()
        out.append(min(max(-math.log(u), 2.0 ** -25), 32.0))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2**32, 2**62, 2**64 - 1])
def test_noise_matches_reference(seed):
    got = seeded_exponential([(seed, stream_position(17, 3))], 64, torch.device("cpu"))[0].tolist()
    assert got == pytest.approx(noise_reference(seed, 3, 17, 64), rel=1e-6)


def test_stream_position_packs_choice_above_the_position():
    assert stream_position(17, 0) == 17 and stream_position(17, 3) == 17 + (3 << 32)
    for bad in ((-1, 0), (2**32, 0), (0, -1)):
        with pytest.raises(ValueError):
            stream_position(*bad)


def test_noise_is_exponential():
    q = seeded_exponential([(12345, stream_position(t, 0)) for t in range(8)], 50_000, torch.device("cpu")).double()
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e; 400k draws put these within a few 1e-3.
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.02
    assert abs((q > 1).double().mean().item() - math.exp(-1)) < 0.005


def test_seeds_that_collided_modulo_2_32_differ():
    keys = [(0, 0), (2**32, 0), (2**62, 0), (0, stream_position(0, 1)), (1, 0), (0, 1)]
    rows = seeded_exponential(keys, 4096, torch.device("cpu"))
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert not torch.equal(rows[i], rows[j]), (i, j)


def test_torch_path_and_kernel_draw_the_same_seeded_tokens():
    """A seeded row's token is a function of (seed, choice, position) whichever path samples it."""
    pytest.importorskip("triton")
    from deepbatch.core.request import Request
    from deepbatch.sampling.sampler import Sampler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 300
    torch.manual_seed(0)
    logits = torch.randn(4, vocab, device=device) * 3
    params = [SamplingParams(temperature=0.8, seed=2**64 - 5), SamplingParams(temperature=1.0, top_p=0.9, seed=7),
              SamplingParams(temperature=0.6, top_k=20, seed=0), SamplingParams(temperature=1.2, min_p=0.05, seed=99)]
    requests = [Request(f"r{i}", [1, 2, 3], p, max_tokens=8) for i, p in enumerate(params)]
    torch_ids = Sampler(vocab, device, fused=False).sample(logits, requests).resolve().token_ids
    kernel_ids = Sampler(vocab, device, fused=True).sample(logits, requests).resolve().token_ids
    assert torch_ids == kernel_ids


def test_kernel_draws_a_seeded_row_alike_in_batches_of_1_7_and_64():
    """The kernel path (the Triton interpreter on the CPU): a seeded row's token depends on its
    seed, choice and position, not on its row or its neighbours."""
    pytest.importorskip("triton")
    from deepbatch.core.request import Request
    from deepbatch.sampling.sampler import Sampler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 300
    g = torch.Generator().manual_seed(1)
    mine_logits = torch.randn(1, vocab, generator=g) * 2
    mine = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=2**63 + 11)
    got = []
    for size in (1, 7, 64):
        logits = torch.randn(size, vocab, generator=g) * 2
        at = size // 2
        logits[at] = mine_logits[0]
        params = [SamplingParams(temperature=1.0, top_p=0.7 if i % 2 else 1.0, seed=i if i % 3 == 0 else None)
                  for i in range(size)]
        params[at] = mine
        requests = [Request(f"r{i}", [1, 2], p, max_tokens=8) for i, p in enumerate(params)]
        ids = Sampler(vocab, device, fused=True).sample(logits.to(device), requests).resolve().token_ids
        got.append(ids[at])
    assert got[0] == got[1] == got[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_is_the_same_on_the_gpu():
    keys = [(2**63 + 5, stream_position(9, 1)), (7, 0)]
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
