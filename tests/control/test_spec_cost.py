"""Speculative decoding's cost model (``control/spec_cost.py``) on step times and acceptance it is
fed by hand: every draft runs while nothing is measured; drafts run where a step's time barely
depends on its tokens and stop where tokens are dear and drafts rarely accepted; the choice is the
cap that a brute-force count of expected tokens per second picks; one step in ``EXPLORE_EVERY``
drafts anyway, under async scheduling too; the counters it reads may be reset."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepbatch.control.spec_cost import EXPLORE_EVERY, SpecCostModel


def fed(a: float, b: float, acceptance: list[float], drafts: int = 1000) -> SpecCostModel:
    """A model fitted on steps of ``a + b * tokens`` seconds (decode-only and mixed shapes) that
    saw ``drafts`` drafts of 4 tokens, position j accepted with probability ``acceptance[j]``."""
    model = SpecCostModel(max_drafts=4)
    for i in range(64):
        seqs = 1 + i % 16
        tokens = seqs + (i % 3) * seqs
        model.observe_step(a + b * tokens, tokens, seqs, [], [])
    accepted = [round(drafts * p) for p in acceptance]
    model.observe_step(a + b, 1, 1, [drafts] * 4, accepted)
    return model


def expected_rate(a, b, acceptance, k, lens, decoding):
    gain = sum(sum(acceptance[:min(k, n)]) for n in lens)
    return (decoding + gain) / (a + b * (decoding + sum(min(k, n) for n in lens)))


def test_every_draft_runs_until_steps_are_measured():
    model = SpecCostModel(max_drafts=4)
    assert model.choose_cap([4, 2], num_decoding=2, num_seqs=2) == 4


def test_drafts_run_where_tokens_are_cheap_and_stop_where_they_are_dear_and_rarely_accepted():
    # A step of 20 ms whatever its tokens (the weights' read dominates): drafts are free.
    cheap = fed(0.020, 1e-6, [0.3, 0.2, 0.1, 0.05])
    assert cheap.choose_cap([4] * 8, num_decoding=8, num_seqs=8) == 4
    # 1 ms a token and drafts rarely accepted (a full batch on compute): none.
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    assert dear.choose_cap([4] * 64, num_decoding=64, num_seqs=64) == 0


@pytest.mark.parametrize("b", [1e-5, 1e-4, 3e-4, 1e-3])
def test_the_cap_is_the_best_by_a_brute_force_count(b):
    a, acceptance = 0.010, [0.8, 0.6, 0.45, 0.3]
    model = fed(a, b, acceptance, drafts=100_000)
    lens, decoding = [4, 4, 3, 1, 2, 4], 10
    rates = [expected_rate(a, b, model.acceptance(), k, lens, decoding) for k in range(5)]
    assert model.choose_cap(lens, decoding, decoding) == max(range(5), key=lambda k: (rates[k], -k))
    assert model.acceptance() == pytest.approx(acceptance, abs=1e-3)


def test_one_step_in_explore_every_drafts_while_the_model_says_no():
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    caps = [dear.choose_cap([3] * 64, 64, 64) for _ in range(2 * EXPLORE_EVERY)]
    assert caps.count(3) == 2 and caps.count(0) == 2 * EXPLORE_EVERY - 2


def test_counters_read_after_a_reset_count_whole():
    model = SpecCostModel(max_drafts=2)
    model.observe_step(0.01, 3, 1, [100, 50], [50, 10])
    model.observe_step(0.01, 3, 1, [10, 5], [5, 1])  # the engine's stats began again
    assert model.drafted == pytest.approx([100 * 0.99 + 10, 50 * 0.99 + 5])
    assert min(model.accepted) > 0


def test_limit_cuts_every_requests_drafts_to_the_cap():
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    running = [SimpleNamespace(spec_token_ids=[1, 2, 3], num_tokens=10, num_computed_tokens=9) for _ in range(64)]
    dear.limit(running)
    assert dear.last_cap == 0 and all(r.spec_token_ids == [] for r in running)


def test_async_steps_stay_free_of_drafts_but_for_the_exploring_ones():
    """``wants_drafts`` (before an asynchronous step) says no where drafts do not pay, except on
    the exploring steps; such a step then runs synchronously and ``choose_cap`` lets every draft
    run, as the engine calls them."""
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    caps = []
    for _ in range(2 * EXPLORE_EVERY):
        if dear.wants_drafts(num_decoding=64, num_seqs=64):
            caps.append(dear.choose_cap([4] * 64, 64, 64))
    assert caps == [4, 4] and dear.num_steps == 2 * EXPLORE_EVERY
    cheap = fed(0.020, 1e-6, [0.3, 0.2, 0.1, 0.05])
    assert cheap.wants_drafts(num_decoding=8, num_seqs=8)
    assert not SpecCostModel(max_drafts=4).wants_drafts(num_decoding=0, num_seqs=3)  # nothing decodes
