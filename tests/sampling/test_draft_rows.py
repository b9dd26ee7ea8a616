"""Verifying drafts by drawing every position as usual (``sampling/draft_rows.py``): the kept
tokens stop at the first draw that differs from its draft; the token in a draft's place follows
the target distribution (temperature, top-k, top-p, min-p, logit bias), computed here by hand in
numpy, and the draft is kept with the probability the target gives it; a seeded row draws what
the request draws at that position without drafts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.core.draft_row import DraftRow
from deepbatch.sampling.draft_rows import kept_rows, sampling_rows
from deepbatch.sampling.pending_sample import PendingSample
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


def test_kept_rows_stop_at_the_first_draw_that_differs():
    # Two drafting requests (rows 0 and 2 of 3): drafts [5, 6] and [7]; their rows follow the 3.
    draws = [9, 1, 4, 5, 8, 7]
    assert kept_rows(draws, 3, [(0, [5, 6]), (2, [7])]) == {0: [3, 4], 2: [5, 2]}
    # Every draft matched: the request's own row gives the token after them.
    assert kept_rows([9, 5, 6], 1, [(0, [5, 6])]) == {0: [1, 2, 0]}
    assert kept_rows([9, 4, 6], 1, [(0, [5, 6])]) == {0: [1]}


def test_draft_rows_see_the_request_from_later_positions():
    r = Request("r", [1, 2], SamplingParams(seed=3), max_tokens=10)
    r.append_output_token(7)
    rows = sampling_rows([r, "other"], [(0, [4, 5])])
    assert [row.num_output_tokens for row in (rows[0], rows[2], rows[3])] == [3, 1, 2]
    assert rows[1] == "other" and all(isinstance(row, DraftRow) and row.request is r for row in rows[2:])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.95),
    SamplingParams(temperature=1.3, min_p=0.1, logit_bias={7: 2.5}),
], ids=["plain", "top_k_top_p", "min_p_bias"])
@pytest.mark.parametrize("draft", [0, 3, 7])
def test_the_token_in_a_drafts_place_follows_the_target(params, draft):
    torch.manual_seed(draft)
    sampler = Sampler(len(LOGITS), "cpu", fused=False)
    requests = [Request(f"r{i}", [0], params, max_tokens=4) for i in range(DRAWS)]
    drafts = [(i, [draft]) for i in range(DRAWS)]
    rows = sampling_rows(requests, drafts)
    draws = sampler.sample(torch.tensor([LOGITS] * len(rows)), rows).resolve().token_ids
    kept = kept_rows(draws, DRAWS, drafts)
    first = np.array([draws[kept[i][0]] for i in range(DRAWS)])
    p = target_probs(params)
    counts = np.bincount(first, minlength=len(p))
    assert counts[p == 0].sum() == 0, (counts, p)  # a filtered token never comes out
    support = p > 0
    expected = DRAWS * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_crit(int(support.sum()) - 1), (chi2, counts, expected)
    # The draft is kept about p(draft) of the time, and then the row after it gives one more token.
    kept_draft = np.array([len(kept[i]) == 2 for i in range(DRAWS)])
    assert abs(kept_draft.mean() - p[draft]) < 0.02
    assert (kept_draft == (first == draft)).all()


def test_a_seeded_draft_row_draws_what_the_request_draws_at_that_position():
    sampler = Sampler(len(LOGITS), "cpu", fused=False)
    params = SamplingParams(temperature=1.0, seed=1234)
    r = Request("r", [0], params, max_tokens=10)
    logits = torch.tensor([LOGITS] * 3)
    drawn = sampler.sample(logits, sampling_rows([r], [(0, [1, 2])])).resolve().token_ids
    # Row 0 is position 2 (past the drafts), rows 1 and 2 positions 0 and 1.
    alone = []
    for position in range(3):
        later = Request("r", [0], params, max_tokens=10)
        for t in range(position):
            later.append_output_token(5)
        alone.append(sampler.sample(logits[:1], [later]).resolve().token_ids[0])
    assert drawn == [alone[2], alone[0], alone[1]]


def test_a_draft_rows_fault_is_its_requests_and_the_others_keep_their_tokens():
    # Rows: request 0 (past its drafts), request 1, then request 0's two draft rows.
    pending = PendingSample(torch.tensor([9, 4, 5, 8]), None, [SamplingParams()] * 4, errors={3: "boom"})
    pending.attach_drafts(2, [(0, [5, 6])])
    out = pending.resolve()
    assert out.errors == {0: "boom"} and out.token_ids[1] == 4
    ok = PendingSample(torch.tensor([9, 4, 5, 6]), None, [SamplingParams()] * 4)
    ok.attach_drafts(2, [(0, [5, 6])])
    out = ok.resolve()
    assert out.errors is None and out.token_ids == [[5, 6, 9], 4] and out.token_rows == {0: [2, 3, 0]}
