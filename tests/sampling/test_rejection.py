"""Verifying drafts (``sampling/rejection.py`` through ``Sampler.verify_drafts``): whatever the
draft, the token that comes out in its place is distributed as the target's own distribution
(temperature, top-k, top-p, min-p, logit bias), computed here by hand in numpy; a greedy row keeps
exactly the drafts equal to its argmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.sampling.rejection import accepted_prefix
from deepbatch.sampling.sampler import Sampler

LOGITS = [2.0, 1.5, 0.9, 0.5, 0.2, -0.2, -0.9, -1.6]
DRAWS = 20_000


def target_probs(params: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from, step by step as vLLM defines it."""
    logits = np.array(LOGITS, dtype=np.float64)
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    p = np.exp(logits / params.temperature - (logits / params.temperature).max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    k = params.top_k if params.top_k > 0 else len(p)
    kept_k = p[order[:k]] / p[order[:k]].sum()
    mass_before = np.cumsum(kept_k) - kept_k
    keep[order[:k][mass_before < params.top_p]] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    p = np.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def chi2_crit(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; z: the normal quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def first_tokens(params: SamplingParams, draft: int, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    sampler = Sampler(len(LOGITS), "cpu", fused=False)
    r = Request("r", [0], params, max_tokens=4)
    logits = torch.tensor([LOGITS] * DRAWS)
    accepted, recovered = sampler.verify_drafts(logits, [r] * DRAWS, [draft] * DRAWS)
    return torch.where(accepted, torch.full_like(recovered, draft), recovered).numpy()


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.95),
    SamplingParams(temperature=1.3, min_p=0.1, logit_bias={7: 2.5}),
]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k_top_p", "min_p_bias"])
@pytest.mark.parametrize("draft", [0, 3, 7])
def test_the_token_in_a_drafts_place_follows_the_target(params, draft):
    p = target_probs(params)
    tokens = first_tokens(params, draft, seed=draft)
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[p == 0].sum() == 0, (counts, p)  # a filtered token never comes out
    support = p > 0
    expected = DRAWS * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_crit(int(support.sum()) - 1), (chi2, counts, expected)
    # The draft is kept about p(draft) of the time: a draft the target likes costs nothing.
    assert abs((tokens == draft).mean() - p[draft]) < 0.02


def test_a_greedy_row_keeps_the_drafts_equal_to_its_argmax():
    sampler = Sampler(len(LOGITS), "cpu", fused=False)
    r = Request("r", [0], SamplingParams(temperature=0.0), max_tokens=4)
    logits = torch.tensor([LOGITS, LOGITS[::-1], LOGITS])
    accepted, recovered = sampler.verify_drafts(logits, [r] * 3, [0, 0, 5])
    assert accepted.tolist() == [True, False, False]
    assert recovered.tolist() == [0, 7, 0]


def test_accepted_prefix_stops_at_the_first_rejection():
    accepted = [True, False, True, True, True]
    recovered = [9, 8, 7, 6, 5]
    assert accepted_prefix(accepted, recovered, [1, 2], 0, bonus=4) == [1, 8]  # draft 2 rejected
    assert accepted_prefix(accepted, recovered, [3, 4, 5], 2, bonus=6) == [3, 4, 5, 6]  # all kept: the bonus
    assert accepted_prefix(accepted, recovered, [2], 1, bonus=6) == [8]
