"""Prompt lookup drafts (``spec_decode/ngram.py``) against a plain-Python reference, and which
requests may draft and how many tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from deepbatch.config import SpeculativeConfig
from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.spec_decode.ngram import NgramProposer, propose_ngram, propose_ngram_ref


def test_the_latest_occurrence_of_the_longest_suffix_gives_the_drafts():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2]
    # Suffix "1 2": latest earlier occurrence at 6, followed by 3 5 1 2.
    assert propose_ngram(np.array(tokens), 2, 2, 3) == [3, 5, 1]
    # Longer suffixes first: "2 1 2"? no; "5 1 2"? no; so n = 2 wins.
    assert propose_ngram(np.array(tokens), 2, 4, 3) == [3, 5, 1]
    # "3 5 1 2" never occurred before; n = 1 finds the "2" at 7, followed by 3.
    assert propose_ngram(np.array(tokens + [9]), 1, 1, 2) == [1, 2]  # "9" at 5 -> 1 2
    assert propose_ngram(np.array([1, 2, 3]), 1, 3, 4) == []  # nothing repeats
    assert propose_ngram(np.array([5]), 1, 3, 4) == []
    assert propose_ngram(np.array([4, 4, 4, 4]), 2, 3, 5) == [4]  # the drafts stop at the sequence's end
    # In a repeating stretch the latest occurrence with k tokens after it wins over the latest.
    assert propose_ngram(np.array([6, 4, 4, 4, 4, 4, 4]), 2, 2, 3) == [4, 4, 4]


def test_matches_the_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(0, 5)
        assert propose_ngram(np.array(tokens), lo, hi, k) == propose_ngram_ref(tokens, lo, hi, k), (tokens, lo, hi, k)


def decoding(params: SamplingParams, prompt=(1, 2, 3, 1, 2), output=(3,), max_tokens=50) -> Request:
    r = Request("r", list(prompt), params, max_tokens=max_tokens)
    for t in output:
        r.append_output_token(t)
    r.num_computed_tokens = r.num_tokens - 1
    return r


@pytest.mark.parametrize("params, drafts", [
    (SamplingParams(temperature=0.0), [1, 2, 3]),  # tokens 1 2 3 1 2 3: "1 2 3" at 0 is followed by 1 2 3
    (SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.1, logit_bias={4: 1.0}), [1, 2, 3]),
    (SamplingParams(seed=3, logprobs=2, min_tokens=5), [1, 2, 3]),
    (SamplingParams(repetition_penalty=1.1, presence_penalty=0.5), [1, 2, 3]),
])
def test_every_decoding_request_drafts(params, drafts):
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), max_model_len=100)
    r = decoding(params)
    proposer.propose([r])
    assert r.spec_token_ids == drafts


def test_drafts_stop_short_of_max_tokens_and_the_context_and_of_a_large_batch():
    cfg = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, disable_by_batch_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    r = decoding(SamplingParams(temperature=0.0), prompt, output=(), max_tokens=3)
    NgramProposer(cfg, max_model_len=100).propose([r])
    assert r.spec_token_ids == [3, 4]  # the step adds the drafts and one more: 3 tokens at most
    r = decoding(SamplingParams(temperature=0.0), prompt, output=())
    NgramProposer(cfg, max_model_len=10).propose([r])
    assert r.spec_token_ids == [3]  # 8 tokens + 1 draft + 1 more = the 10 positions
    rs = [decoding(SamplingParams(temperature=0.0), prompt, output=()) for _ in range(3)]
    NgramProposer(cfg, max_model_len=100).propose(rs)
    assert all(r.spec_token_ids == [] for r in rs)  # 3 running > disable_by_batch_size
    prefilling = decoding(SamplingParams(temperature=0.0), prompt, output=())
    prefilling.num_computed_tokens = 2
    NgramProposer(cfg, max_model_len=100).propose([prefilling])
    assert prefilling.spec_token_ids == []


def test_the_proposers_arrays_follow_the_requests_tokens_across_steps():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    proposer = NgramProposer(cfg, max_model_len=10_000)
    rng = random.Random(1)
    r = decoding(SamplingParams(temperature=0.0), [rng.randrange(5) for _ in range(40)], output=(), max_tokens=5000)
    for _ in range(200):  # the array grows past its first capacity
        proposer.propose([r])
        assert r.spec_token_ids == propose_ngram_ref(r.all_token_ids, 1, 3, 3)
        for t in [rng.randrange(5) for _ in range(rng.randint(1, 4))]:
            r.append_output_token(t)
        r.num_computed_tokens = r.num_tokens - 1
