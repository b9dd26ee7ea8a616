"""The rollout's logic without Ray: spec checks, tenant hashing, the SLO watch's timing against a
fake clock, promotion through the steps, rollback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepbatch.serve_ray.rollout import BUCKETS, CANARY, STABLE, RolloutController, quantile, tenant_bucket
from deepbatch.serve_ray.rollout_spec import load_spec, parse_spec


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(spec: dict, has_canary: bool = True):
    clock = FakeClock()
    return RolloutController(parse_spec(spec), has_canary, clock=clock, wall_clock=clock), clock


def run(controller: RolloutController, clock: FakeClock, until: float, events=()) -> None:
    """Advance the fake clock to ``until`` as the watch loop would, applying ``events``
    ((time, fn) pairs, in order) when their time comes."""
    events = sorted(events, key=lambda e: e[0])
    while True:
        # A real clock always moves on; so does this one.
        due = clock.now + max(controller.seconds_to_next_evaluation(), 1e-3)
        while events and events[0][0] <= due:
            t, fn = events.pop(0)
            clock.now = max(clock.now, t)
            fn()
        if due > until:
            clock.now = until
            return
        clock.now = due
        controller.evaluate()


# -- spec ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, field", [
    ({"stepz": [100]}, "unknown field(s) stepz"),
    ({"steps": [5, 1, 100]}, "rollout.steps: must be strictly increasing"),
    ({"steps": [1, 50]}, "the last step must be 100"),
    ({"steps": [0, 100]}, "rollout.steps: each step is a percent in (0, 100]"),
    ({"steps": []}, "rollout.steps: must be a non-empty list"),
    ({"hold_s": -1}, "rollout.hold_s: must be >= 0"),
    ({"window_s": 0}, "rollout.window_s: must be > 0"),
    ({"evaluation_interval_s": "10"}, "rollout.evaluation_interval_s: must be a finite number"),
    ({"min_samples": 1.5}, "rollout.min_samples: must be an integer"),
    ({"slo": [{"metric": "ttft_p90_ms", "max": 1, "for_s": 1}]}, "rollout.slo[0].metric: must be one of"),
    ({"slo": [{"metric": "error_rate", "max": 2, "for_s": 1}]}, "rollout.slo[0].max: an error rate is a fraction"),
    ({"slo": [{"metric": "error_rate", "for_s": 1}]}, "rollout.slo[0].max: required"),
    ({"slo": [{"metric": "error_rate", "max": 0.1, "for": 1}]}, "rollout.slo[0]: unknown field(s) for"),
    ({"slo": [{"metric": "error_rate", "max": 0.1}, {"metric": "error_rate", "max": 0.2}]}, "one rule only"),
    ({"slo": {"metric": "error_rate"}}, "rollout.slo: must be a list"),
])
def test_bad_spec_names_the_field(spec, field):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    assert field in str(e.value)


def test_spec_from_yaml_file_json_string_and_defaults(tmp_path):
    path = tmp_path / "rollout.yaml"
    path.write_text("steps: [10, 100]\nhold_s: 30\nslo:\n  - {metric: tpot_p99_ms, max: 50, for_s: 60}\n")
    spec = load_spec(str(path))
    assert spec.steps == (10.0, 100.0) and spec.hold_s == 30.0
    assert [(r.metric, r.max, r.for_s) for r in spec.slo] == [("tpot_p99_ms", 50.0, 60.0)]
    assert load_spec(json.dumps(spec.as_dict())) == spec
    default = load_spec(None)
    assert default.steps == (1.0, 5.0, 25.0, 50.0, 100.0)
    assert {r.metric for r in default.slo} == {"error_rate", "ttft_p95_ms"}
    with pytest.raises(ValueError, match="neither a file nor a mapping"):
        load_spec(str(tmp_path / "missing.yaml"))


# -- tenants ------------------------------------------------------------------------------------

def test_tenant_bucket_is_the_same_in_another_process():
    keys = ["alice", "bob", "tenant-42", "ünïcode"]
    code = ("import json,sys; from deepbatch.serve_ray.rollout import tenant_bucket; "
            f"print(json.dumps([tenant_bucket(k) for k in {keys!r}]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert json.loads(other.stdout) == [tenant_bucket(k) for k in keys]


def test_raising_the_percent_only_adds_tenants_to_the_canary():
    controller, _ = make({"steps": [5, 25, 100], "hold_s": 0, "min_requests_per_step": 0})
    tenants = [f"user-{i}" for i in range(4000)]
    arms = {}
    for expected in (5, 25, 100):
        assert controller.canary_percent == expected
        on_canary = {t for t in tenants if controller.arm_for(t) == CANARY}
        assert abs(len(on_canary) / len(tenants) - expected / 100) < 0.03
        # By the definition, not by the code under test: the canary holds the low buckets.
        assert on_canary == {t for t in tenants if tenant_bucket(t) < expected * BUCKETS / 100}
        for t in arms.get("previous", set()):
            assert t in on_canary
        arms["previous"] = on_canary
        controller.evaluate()


def test_without_a_canary_everything_is_stable():
    controller, _ = make({}, has_canary=False)
    assert controller.state == "off" and controller.canary_percent == 0
    assert {controller.arm_for(f"u{i}") for i in range(100)} == {STABLE}


def test_quantile_is_nearest_rank():
    values = list(range(1, 101))
    assert quantile(values, 0.95) == 95 and quantile(values, 0.99) == 99 and quantile([7.0], 0.99) == 7.0
    assert quantile(values[::-1], 0.5) == 50


# -- the SLO watch ------------------------------------------------------------------------------

WATCH = {"steps": [50, 100], "hold_s": 10_000, "window_s": 30, "evaluation_interval_s": 1.0, "min_samples": 3,
         "slo": [{"metric": "error_rate", "max": 0.2, "for_s": 5}, {"metric": "ttft_p95_ms", "max": 800, "for_s": 4}]}


@pytest.mark.parametrize("offset", [0.0, 0.3, 0.999])
def test_error_breach_rolls_back_within_for_s_plus_one_interval(offset):
    controller, clock = make(WATCH)
    rolled = []
    controller.add_rollback_listener(lambda: rolled.append(clock.now))
    start = clock.now + 2 + offset  # the breach begins between two evaluations
    events = [(start + 0.01 * i, lambda: controller.record_outcome(CANARY, error=True)) for i in range(3)]
    events.append((start, lambda: controller.record_outcome(STABLE, error=True)))
    run(controller, clock, start + 30, events)
    assert controller.state == "rolled_back" and controller.canary_percent == 0
    assert len(rolled) == 1
    breach_visible = start + 0.02  # the third sample reaches min_samples
    assert 5 <= rolled[0] - breach_visible <= 5 + 1.0
    assert controller.num_rollbacks == 1
    decision = controller.history[-1]
    assert decision["action"] == "rollback" and decision["reason"].startswith("error_rate = 1 above 0.2")
    assert {controller.arm_for(f"u{i}") for i in range(200)} == {STABLE}


def test_a_breach_shorter_than_for_s_is_forgiven():
    controller, clock = make(WATCH)
    t0 = clock.now + 1.5
    bad = [(t0 + 0.01 * i, lambda: controller.record_ttft(CANARY, 2.0)) for i in range(3)]
    # Three seconds later enough fast samples bring p95 back under 800 ms (3 slow of 60 = 5%).
    good = [(t0 + 3 + 0.001 * i, lambda: controller.record_ttft(CANARY, 0.1)) for i in range(57)]
    run(controller, clock, t0 + 20, bad + good)
    assert controller.state == "progressing" and controller.num_rollbacks == 0


def test_p95_ttft_breach_and_old_samples_leave_the_window():
    controller, clock = make({**WATCH, "window_s": 5, "slo": [{"metric": "ttft_p95_ms", "max": 800, "for_s": 2}]})
    t0 = clock.now + 1
    # Slow samples that age out of the 5 s window before for_s could pass: no rollback.
    slow_then_gone = [(t0 + 0.01 * i, lambda: controller.record_ttft(CANARY, 1.5)) for i in range(3)]
    fast = [(t0 + 1 + 0.01 * i, lambda: controller.record_ttft(CANARY, 0.05)) for i in range(100)]
    run(controller, clock, t0 + 10, slow_then_gone + fast)
    assert controller.state == "progressing"
    report = controller.report()
    assert report["arms"][CANARY]["ttft_p95_ms"] is None  # everything aged out (window 5 s)
    # Now a sustained breach: 10 of 20 slow.
    t1 = clock.now + 0.5
    mixed = [(t1 + 0.01 * i, (lambda v: lambda: controller.record_ttft(CANARY, v))(1.5 if i % 2 else 0.05))
             for i in range(20)]
    run(controller, clock, t1 + 10, mixed)
    assert controller.state == "rolled_back"
    assert controller.history[-1]["reason"].startswith("ttft_p95_ms = 1500 above 800")


def test_too_few_samples_are_not_judged():
    controller, clock = make({**WATCH, "min_samples": 5})
    events = [(clock.now + 1 + i, lambda: controller.record_outcome(CANARY, error=True)) for i in range(4)]
    run(controller, clock, clock.now + 40, events)
    assert controller.state == "progressing"


# -- promotion ----------------------------------------------------------------------------------

def test_healthy_canary_is_promoted_through_every_step():
    spec = {"steps": [1, 5, 25, 50, 100], "hold_s": 3, "evaluation_interval_s": 0.5, "min_samples": 1,
            "min_requests_per_step": 2, "slo": [{"metric": "error_rate", "max": 0.05, "for_s": 1}]}
    controller, clock = make(spec)
    seen = [controller.canary_percent]
    events = []
    for i in range(200):  # two healthy canary replies every 0.25 s
        events.append((clock.now + 0.25 * i, lambda: controller.record_outcome(CANARY, error=False, e2e=0.1)))
        events.append((clock.now + 0.25 * i + 0.01, lambda: seen.append(controller.canary_percent)))
    run(controller, clock, clock.now + 40, events)
    assert controller.state == "promoted" and controller.canary_percent == 100
    assert list(dict.fromkeys(seen)) == [1, 5, 25, 50, 100]
    actions = [(h["action"], h["canary_percent"]) for h in controller.history]
    assert actions == [("start", 1), ("promote", 5), ("promote", 25), ("promote", 50), ("promote", 100),
                       ("promoted", 100)]
    times = [h["time"] for h in controller.history]
    assert all(b - a >= 3 for a, b in zip(times[:-1], times[1:]))  # every step held hold_s
    assert controller.num_promotions == 4


def test_promotion_waits_for_canary_traffic_and_restart_starts_over():
    controller, clock = make({"steps": [10, 100], "hold_s": 1, "evaluation_interval_s": 0.5,
                              "min_requests_per_step": 3})
    run(controller, clock, clock.now + 10)
    assert controller.state == "progressing" and controller.canary_percent == 10  # no evidence, no promotion
    controller.rollback("by hand")
    assert controller.state == "rolled_back" and controller.canary_percent == 0
    controller.restart(parse_spec({"steps": [100], "hold_s": 0, "min_requests_per_step": 0}))
    assert controller.state == "progressing" and controller.canary_percent == 100
    controller.evaluate()
    assert controller.state == "promoted"
    assert [h["action"] for h in controller.history] == ["start", "rollback", "start", "promoted"]
