"""The SLO controller on a simulated runner: the real scheduler on a fake clock, with step time
``2 ms + 0.05 ms * batched_tokens + 0.02 ms * seqs`` and seeded Poisson arrivals, so every run
is fast and repeats exactly.

The load: prompts of 100-300 tokens, outputs of 50-150, targets p99 TTFT 2 s and p99 TPOT
10 ms. At 46 requests/s the default limits (256 seats) let concurrency swing with the arrivals,
and p99 TPOT goes past the target; a cap on seats bounds the step time, at the price of a queue.
"""

from __future__ import annotations

import random

import pytest

from slo_sim import StepModel, make_scheduler, p99, poisson_arrivals, simulate
from deepbatch.config import SchedulerConfig
from deepbatch.control.controller import ControllerOptions, SLOController, make_controller
from deepbatch.control.slo_frontier import Setting, Workload, candidate_settings, predict
from deepbatch.control.step_time import StepTimeCoeffs, StepTimeFit

TTFT, TPOT = 2.0, 0.010
RATE, DURATION = 46.0, 20.0
SETTLE = 6.0  # seconds after which the controller has converged
GRID = [(s, b) for s in (16, 32, 64, 128, 256) for b in (512, 8192)]


def arrivals(rate=RATE, duration=DURATION, seed=1):
    return poisson_arrivals(rate, duration, (100, 300), (50, 150), seed=seed)


def run_fixed(seqs, tokens, arr):
    sched, clock = make_scheduler(seqs, tokens)
    return simulate(arr, sched, clock)


def run_controlled(arr, ttft=TTFT, tpot=TPOT):
    sched, clock = make_scheduler()
    controller = SLOController(sched, ttft, tpot)
    return simulate(arr, sched, clock, controller=controller), controller


@pytest.fixture(scope="module")
def loaded():
    arr = arrivals()
    res, controller = run_controlled(arr)
    return arr, res, controller


# -- the step-time fit -------------------------------------------------------------------------


def test_fit_recovers_the_step_time_model_from_mixed_steps():
    model = StepModel()
    res = run_fixed(256, 512, arrivals(rate=30.0, duration=5.0))
    fit = StepTimeFit()
    for tokens, seqs, dt in res.step_log:
        fit.observe(tokens, seqs, dt)
    assert fit.num_mixed > 100  # chunked prefills rode along with decodes
    got = fit.fit()
    assert got.a == pytest.approx(model.a, rel=0.02)
    assert got.b == pytest.approx(model.b, rel=0.02)
    assert got.c == pytest.approx(model.c, rel=0.05)


def test_fit_of_decode_only_steps_charges_the_sequence_cost_to_tokens():
    # tokens == seqs in every step: only b + c is identified. The fit must not blow up or go
    # negative; it predicts decode steps exactly and puts c at 0.
    model = StepModel()
    fit = StepTimeFit()
    for n in range(1, 200):
        fit.observe(n, n, model.duration(n, n))
    got = fit.fit()
    assert got.c == pytest.approx(0.0, abs=1e-7)
    assert got.b == pytest.approx(model.b + model.c, rel=1e-3)
    assert got.a == pytest.approx(model.a, rel=1e-3)
    assert got.predict(64, 64) == pytest.approx(model.duration(64, 64), rel=1e-3)


def test_fit_over_a_sliding_window_equals_a_fit_of_the_window_alone():
    # The running sums drop steps as the window slides; the fit must be the one of the steps
    # still in it (a fresh fit over them), through evictions and periodic re-summing.
    rng = random.Random(3)
    model = StepModel()
    sliding = StepTimeFit(window=64, min_steps=8)
    steps = []
    for _ in range(1000):
        tokens, seqs = rng.randint(1, 4096), rng.randint(1, 256)
        dt = model.duration(tokens, seqs) * rng.uniform(0.9, 1.1)
        steps.append((tokens, seqs, dt))
        sliding.observe(tokens, seqs, dt)
    fresh = StepTimeFit(window=64, min_steps=8)
    for step in steps[-64:]:
        fresh.observe(*step)
    assert list(sliding.steps) == steps[-64:]
    assert sliding.num_mixed == sum(t != s for t, s, _ in steps[-64:])
    got, want = sliding.fit(), fresh.fit()
    for name in ("a", "b", "c"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-6, abs=1e-12)


def test_fit_guards_against_too_few_or_degenerate_steps():
    fit = StepTimeFit(min_steps=8)
    for _ in range(7):
        fit.observe(10, 10, 0.003)
    assert fit.fit() is None  # too few
    for _ in range(50):
        fit.observe(10, 10, 0.003)
    assert fit.fit() is None  # one shape: intercept and slope not separable
    noisy = StepTimeFit(min_steps=8)
    for i in range(50):  # a decreasing trend would fit a negative slope: pinned at 0
        noisy.observe(10 + i, 10 + i, 0.01 - 1e-5 * i)
    got = noisy.fit()
    assert got is not None and min(got.a, got.b, got.c) >= 0.0


# -- the frontier ------------------------------------------------------------------------------


def test_ttft_counts_prompt_tokens_already_queued():
    m = StepTimeCoeffs(2e-3, 0.05e-3, 0.02e-3)
    calm = Workload(10.0, 200.0, 300.0, 100.0, backlog_tokens=0)
    burst = Workload(10.0, 200.0, 300.0, 100.0, backlog_tokens=50_000)
    small, large = Setting(64, 256), Setting(64, 4096)
    assert predict(m, burst, small)[1] > predict(m, calm, small)[1] + 1.0
    # Under a burst the larger budget drains the queue faster, so it must predict the lower TTFT.
    assert predict(m, burst, large)[1] < predict(m, burst, small)[1]


def test_candidates_stay_under_the_configured_limits():
    cands = candidate_settings(256, 8192)
    assert Setting(256, 8192) in cands
    assert all(1 <= c.max_num_seqs <= 256 and c.max_num_seqs <= c.max_num_batched_tokens <= 8192 for c in cands)


def test_no_controller_without_targets():
    sched, _ = make_scheduler()
    assert make_controller(sched) is None
    sched.config = SchedulerConfig(slo_tpot_ms=50.0)
    assert make_controller(sched).tpot_target_s == pytest.approx(0.05)


# -- closed loop -------------------------------------------------------------------------------


def test_default_setting_violates_the_slo_at_this_load():
    res = run_fixed(256, 8192, arrivals())
    assert p99(res.tpots(SETTLE)) > TPOT


def test_controller_converges_to_settings_that_meet_the_slo(loaded):
    _, res, controller = loaded
    assert p99(res.ttfts(SETTLE)) <= TTFT
    assert p99(res.tpots(SETTLE)) <= TPOT
    assert controller.setting.max_num_seqs < 256  # it had to cap the seats to get there
    report = controller.report
    assert report["settings"]["max_num_seqs"] == controller.setting.max_num_seqs
    assert report["step_time_model"]["b_ms_per_token"] == pytest.approx(0.05, rel=0.05)
    assert any(p["meets"] for p in report["frontier"])


def test_goodput_is_at_least_the_best_fixed_setting_of_a_grid(loaded):
    arr, res, _ = loaded
    fixed = {sb: run_fixed(*sb, arr).goodput(TTFT, TPOT) for sb in GRID}
    best = max(fixed, key=fixed.get)
    assert res.goodput(TTFT, TPOT) >= fixed[best], (res.goodput(TTFT, TPOT), best, fixed)


def test_hysteresis_bounds_setting_changes_on_a_steady_load(loaded):
    _, res, controller = loaded
    decisions = res.num_steps // ControllerOptions().interval_steps
    assert decisions > 30  # many chances to move
    assert controller.num_changes <= 6, controller.num_changes
    assert res.changes(since=SETTLE) <= 2


def test_steady_load_inside_the_targets_keeps_the_default():
    res, controller = run_controlled(arrivals(rate=30.0))
    assert controller.num_changes <= 2
    assert p99(res.tpots(SETTLE)) <= TPOT and p99(res.ttfts(SETTLE)) <= TTFT


def test_infeasible_targets_do_not_collapse_throughput():
    arr = arrivals(rate=40.0)
    default = run_fixed(256, 8192, arr)
    res, controller = run_controlled(arr, ttft=1e-4, tpot=1e-4)
    assert not any(p["meets"] for p in controller.report["frontier"])
    assert res.throughput() >= 0.95 * default.throughput()
    assert p99(res.ttfts(SETTLE)) <= 2 * p99(default.ttfts(SETTLE)) + 0.05


def test_the_report_crosses_to_the_api_process_as_its_values(loaded):
    # The engine core pickles its snapshot, report included, for the API process.
    import pickle

    report = loaded[2].report
    copy = pickle.loads(pickle.dumps(report))
    assert copy.as_dict() == report.as_dict() and dict(copy) == dict(report)
    assert copy["frontier"] and copy["num_steps"] == report["num_steps"] > 0
