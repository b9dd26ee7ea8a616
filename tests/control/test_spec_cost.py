"""Speculative decoding's cost model (``control/spec_cost.py``) on step times and acceptance it is
fed by hand: steps alternate between every draft and none while nothing is measured; the fixed
and per-draft cost of a drafting step are measured apart from the plain step time; drafts run
where they pay and stop where a drafting step costs more than its accepted drafts gain (tokens
dear and drafts rarely accepted, or a drafting step's fixed cost at batch 1); each request's cap is
the best of every possible assignment (counted exhaustively); a request's own record moves its
acceptance; now and then a step takes the other arm, under async scheduling too, spaced so that
such steps lose at most ``EXPLORE_BUDGET`` of the throughput; the counters it reads may be
reset."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from deepbatch.control.spec_cost import (ACCEPTANCE_DECAY, EXPLORE_BUDGET, EXPLORE_EVERY, MAX_EXPLORE_EVERY,
                                        SpecCostModel)


def fed(a: float, b: float, acceptance: list[float], drafts: int = 1000, overhead: float = 0.0) -> SpecCostModel:
    """A model fitted on plain steps of ``a + b * tokens`` seconds (decode-only and mixed shapes)
    and drafting steps that cost ``overhead`` more, which saw ``drafts`` drafts of 4 tokens,
    position j accepted with probability ``acceptance[j]``."""
    model = SpecCostModel(max_drafts=4)
    for i in range(64):
        seqs = 1 + i % 16
        tokens = seqs + (i % 3) * seqs
        model.observe_step(a + b * tokens, tokens, seqs, [], [])
    for i in range(16):
        seqs = 1 + i % 8
        n = seqs * (1 + i % 4)  # drafts
        model.observe_step(a + b * (seqs + n) + overhead, seqs + n, seqs, [], [], num_drafts=n)
    accepted = [round(drafts * p) for p in acceptance]
    model.observe_step(a + b, 1, 1, [drafts] * 4, accepted)
    return model


def rate(a, b, acceptance, caps, decoding, overhead=0.0):
    """Expected output tokens per second of a step with these caps (the model's objective)."""
    gain = sum(sum(p[:k]) for p, k in zip(acceptance, caps))
    return (decoding + gain) / (a + b * (decoding + sum(caps)) + (overhead if any(caps) else 0.0))


def request(drafted: list[int], accepted: list[int], drafts: int = 4):
    return SimpleNamespace(spec_drafted=drafted, spec_accepted=accepted, spec_token_ids=list(range(drafts)),
                           num_tokens=10, num_computed_tokens=9)


def test_steps_alternate_between_every_draft_and_none_until_both_are_measured():
    model = SpecCostModel(max_drafts=4)
    caps = [model.choose_caps([[0.5] * 4] * 2, [4, 2], num_decoding=2, num_seqs=2) for _ in range(4)]
    assert caps == [[4, 2], [0, 0], [4, 2], [0, 0]]
    assert model.wants_drafts(num_decoding=2, num_seqs=2)  # the drafting arm must be measured


def test_a_drafting_steps_cost_is_measured_apart_from_its_tokens():
    model = fed(0.002, 1e-4, [0.5] * 4, overhead=0.0009)
    d0, d1 = model.draft_cost(seconds_per_token=1.0)
    assert d0 == pytest.approx(0.0009, rel=1e-3) and d1 == pytest.approx(1e-4, rel=1e-3)
    assert SpecCostModel(max_drafts=4).draft_cost(1e-4) is None


def test_drafting_steps_before_the_plain_fit_are_measured_once_it_exists():
    model = SpecCostModel(max_drafts=4)
    for _ in range(10):  # 2 ms over a plain step of its 6 tokens, 4 of them drafts
        model.observe_step(0.001 + 6e-4 * 6 + 0.002, 6, 2, [], [], num_drafts=4)
    assert model.draft_cost(6e-4) is None and model.num_drafting_steps == 10
    for i in range(40):
        model.observe_step(0.001 + 6e-4 * (1 + i % 4), 1 + i % 4, 1 + i % 4, [], [])
    model.observe_step(0.001 + 6e-4 * 6 + 0.002, 6, 2, [], [], num_drafts=4)
    d0, d1 = model.draft_cost(6e-4)
    assert (d0, d1) == pytest.approx((0.002, 6e-4), rel=1e-3)


def test_a_steady_batch_of_one_shape_is_priced_by_its_mean_step():
    # Plain steps all of 32 decodes (no fit can separate a, b, c): their mean time stands in.
    model = SpecCostModel(max_drafts=4)
    for i in range(8):
        model.observe_step(0.010 + 1e-4 * (i % 2), 32, 32, [], [])
        model.observe_step(0.030, 32 + 128, 32, [128] * 4, [0] * 4, num_drafts=128)
    assert model.fit.fit() is None
    d0, d1 = model.draft_cost(0.0)
    assert d0 + 128 * d1 == pytest.approx(0.030 - 0.01005, rel=1e-6)
    assert model.choose_caps([model.acceptance()] * 32, [4] * 32, 32, 32) == [0] * 32  # 3x the time, none kept


def test_at_batch_1_a_drafting_steps_fixed_cost_must_be_earned_by_its_accepted_drafts():
    # A decode step of 1.5 ms whatever its tokens, a drafting step 60% dearer (synchronous, the
    # draft rows sampled): drafts rarely accepted stop, drafts mostly accepted run.
    rare = fed(0.0015, 1e-7, [0.05, 0.01, 0.0, 0.0], overhead=0.0009)
    assert rare.choose_caps([rare.acceptance()], [4], num_decoding=1, num_seqs=1) == [0]
    assert not rare.wants_drafts(num_decoding=1, num_seqs=1)
    likely = fed(0.0015, 1e-7, [0.9, 0.8, 0.7, 0.6], overhead=0.0009)
    assert likely.choose_caps([likely.acceptance()], [4], num_decoding=1, num_seqs=1) == [4]
    assert likely.wants_drafts(num_decoding=1, num_seqs=1)


def test_drafts_run_where_tokens_are_cheap_and_stop_where_they_are_dear_and_rarely_accepted():
    # A step of 20 ms whatever its tokens (the weights' read dominates): drafts are free.
    cheap = fed(0.020, 1e-6, [0.3, 0.2, 0.1, 0.05])
    assert cheap.choose_caps([cheap.acceptance()] * 8, [4] * 8, num_decoding=8, num_seqs=8) == [4] * 8
    # 1 ms a token and drafts rarely accepted (a full batch on compute): none.
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    assert dear.choose_caps([dear.acceptance()] * 64, [4] * 64, num_decoding=64, num_seqs=64) == [0] * 64


@pytest.mark.parametrize("b", [1e-5, 1e-4, 3e-4, 1e-3, 3e-3])
@pytest.mark.parametrize("overhead", [0.0, 0.004])
def test_the_caps_are_the_best_of_every_assignment(b, overhead):
    a = 0.010
    model = fed(a, b, [0.8, 0.6, 0.45, 0.3], drafts=100_000, overhead=overhead)
    acceptance = [[0.9, 0.8, 0.7, 0.6], [0.5, 0.3, 0.1, 0.05], [0.7, 0.7, 0.2, 0.2], [0.2, 0.1, 0.0, 0.0]]
    lens, decoding = [4, 3, 4, 2], 6
    caps = model.choose_caps(acceptance, lens, decoding, decoding)
    best = max(rate(a, b, acceptance, c, decoding, overhead)
               for c in itertools.product(*(range(n + 1) for n in lens)))
    assert rate(a, b, acceptance, caps, decoding, overhead) == pytest.approx(best, rel=1e-6), caps
    assert all(0 <= c <= n for c, n in zip(caps, lens))
    assert model.acceptance() == pytest.approx([0.8, 0.6, 0.45, 0.3], abs=1e-3)


def test_a_requests_own_record_moves_its_acceptance():
    model = fed(0.010, 3e-4, [0.5, 0.4, 0.3, 0.2])
    fresh = model.request_acceptance(request([], []))
    assert fresh == pytest.approx(model.acceptance())
    copier = model.request_acceptance(request([40] * 4, [38, 36, 34, 32]))
    never = model.request_acceptance(request([40] * 4, [0] * 4))
    assert all(c > 0.7 for c in copier) and all(n < 0.1 for n in never)
    assert all(x >= y for x, y in zip(copier, copier[1:]))  # never rising with the position
    # In one step the copier keeps its drafts and the other loses them.
    running = [request([40] * 4, [38, 36, 34, 32]), request([40] * 4, [0] * 4)]
    model.limit(running)
    assert model.last_caps[0] == 4 and model.last_caps[1] == 0
    assert [len(r.spec_token_ids) for r in running] == model.last_caps


def explorations(model, acceptance, drafts: int, seqs: int, steps: int) -> list[list[int]]:
    """The caps of the steps that took the arm the model does not choose, over ``steps``."""
    caps = [model.choose_caps([acceptance] * seqs, [drafts] * seqs, seqs, seqs) for _ in range(steps)]
    usual = max(set(map(tuple, caps)), key=lambda c: caps.count(list(c)))
    return [c for c in caps if tuple(c) != usual]


def test_exploring_drafts_where_they_do_not_pay_costs_at_most_the_budget():
    # 64 requests, tokens dear: a step of every draft takes about four plain steps' time and gains
    # little, so it comes rarely.
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    acc, steps = dear.acceptance(), 4 * MAX_EXPLORE_EVERY
    explored = explorations(dear, acc, 3, 64, steps)
    assert explored and all(c == [3] * 64 for c in explored)
    t_plain, t_all = 0.002 + 0.001 * 64, 0.002 + 0.001 * (64 + 3 * 64)
    lost = t_all - (64 + 64 * sum(acc[:3])) * t_plain / 64  # beyond what its tokens take at the plain rate
    assert len(explored) * lost <= EXPLORE_BUDGET * steps * t_plain * 1.02
    assert len(explored) >= steps // MAX_EXPLORE_EVERY


def test_cheap_exploring_comes_every_explore_every_steps():
    # Batch 1, drafts just short of paying: a drafting step loses a tenth of a plain step.
    near = fed(0.010, 1e-5, [0.3, 0.1, 0.0, 0.0], overhead=0.005)
    explored = explorations(near, near.acceptance(), 4, 1, 2 * EXPLORE_EVERY)
    assert explored == [[4]] * 2


def test_exploring_without_drafts_where_they_pay_costs_at_most_the_budget():
    cheap = fed(0.020, 1e-6, [0.9, 0.8, 0.7, 0.6])
    acc, steps = cheap.acceptance(), 4 * MAX_EXPLORE_EVERY
    explored = explorations(cheap, acc, 4, 8, steps)
    assert explored and all(c == [0] * 8 for c in explored)
    best = rate(0.020, 1e-6, [acc] * 8, [4] * 8, 8)
    lost = 0.020 - 8 / best  # a plain step, beyond what its 8 tokens take at the drafting rate
    t_best = (8 + 8 * sum(acc)) / best
    assert len(explored) * lost <= EXPLORE_BUDGET * steps * t_best * 1.02


def test_counters_read_after_a_reset_count_whole():
    model = SpecCostModel(max_drafts=2)
    model.observe_step(0.01, 3, 1, [100, 50], [50, 10])
    model.observe_step(0.01, 3, 1, [10, 5], [5, 1])  # the engine's stats began again
    assert model.drafted == pytest.approx([100 * ACCEPTANCE_DECAY + 10, 50 * ACCEPTANCE_DECAY + 5])
    assert min(model.accepted) > 0


def test_async_steps_stay_free_of_drafts_but_for_the_exploring_ones():
    """``wants_drafts`` (before an asynchronous step) says no where drafts do not pay, except on
    the exploring steps; such a step then runs synchronously and ``choose_caps`` lets every draft
    run, as the engine calls them."""
    dear = fed(0.002, 0.001, [0.1, 0.02, 0.01, 0.0])
    caps, steps = [], 2 * MAX_EXPLORE_EVERY
    for _ in range(steps):
        if dear.wants_drafts(num_decoding=64, num_seqs=64):
            caps.append(dear.choose_caps([dear.acceptance()] * 64, [4] * 64, 64, 64))
    assert caps == [[4] * 64] * (steps // dear.explore_every) and dear.num_steps == steps
    assert EXPLORE_EVERY < dear.explore_every <= MAX_EXPLORE_EVERY
    cheap = fed(0.020, 1e-6, [0.3, 0.2, 0.1, 0.05])
    assert cheap.wants_drafts(num_decoding=8, num_seqs=8)
    assert not SpecCostModel(max_drafts=4).wants_drafts(num_decoding=0, num_seqs=3)  # nothing decodes


def test_under_async_scheduling_the_plain_steps_that_learn_or_explore_stay_asynchronous():
    # ``wants_drafts`` False is an asynchronous plain step: the learning alternates drafting steps
    # with such steps, and where drafts pay the exploring step is one too, so the plain step time
    # is measured as the engine runs plain steps (not as a synchronous step with no drafts).
    fresh = SpecCostModel(max_drafts=4)
    assert [fresh.wants_drafts(num_decoding=2, num_seqs=2) for _ in range(4)] == [True, False, True, False]
    cheap = fed(0.020, 1e-6, [0.9, 0.8, 0.7, 0.6])
    answers, caps = [], []
    for _ in range(4 * MAX_EXPLORE_EVERY):
        answers.append(cheap.wants_drafts(num_decoding=8, num_seqs=8))
        if answers[-1]:
            caps.append(cheap.choose_caps([cheap.acceptance()] * 8, [4] * 8, 8, 8))
    assert 0 < answers.count(False) <= len(answers) // EXPLORE_EVERY
    assert caps and all(c == [4] * 8 for c in caps)  # the drafting steps keep every draft


def test_the_arm_is_chosen_by_the_acceptance_the_caps_are_chosen_by():
    # The engine-wide figure still says drafts are mostly accepted (it ages only as drafts run),
    # while every decoding request's own record says they never are: judged by the records, as
    # ``choose_caps`` will judge them, the step stays plain and asynchronous instead of running
    # synchronously for drafts that are then all cut.
    model = fed(0.0015, 1e-6, [0.9, 0.8, 0.7, 0.6], overhead=0.0005)
    assert model.wants_drafts(num_decoding=8, num_seqs=8)  # the engine-wide figure alone
    never = [request([40] * 4, [0] * 4) for _ in range(8)]
    assert not model.wants_drafts(num_decoding=8, num_seqs=8, requests=never)
    assert model.choose_caps([model.request_acceptance(r) for r in never], [4] * 8, 8, 8) == [0] * 8
    copying = [request([40] * 4, [38, 36, 34, 32]) for _ in range(8)]
    assert model.wants_drafts(num_decoding=8, num_seqs=8, requests=copying)


def test_a_step_run_for_drafts_that_kept_none_is_not_a_plain_step():
    # Under async scheduling such a step ran synchronously (and proposed): its time would make a
    # plain step look dearer and drafting cheaper than they are. It counts with the drafting
    # steps, as one of no drafts: what the drafting arm costs before any draft.
    model = fed(0.0015, 1e-6, [0.5] * 4)
    plain_steps = len(model.fit.steps)
    drafting = model.num_drafting_steps
    model.observe_step(0.0025, 8, 8, [1000] * 4, [500] * 4, num_drafts=0, drafting_arm=True)
    assert len(model.fit.steps) == plain_steps and model.num_drafting_steps == drafting + 1
    model.observe_step(0.0015, 8, 8, [1000] * 4, [500] * 4, num_drafts=0)
    assert len(model.fit.steps) == plain_steps + 1
