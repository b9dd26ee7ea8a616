"""The rollout spec: promotion steps, hold time, the SLO rules a canary is held to.

A spec is a mapping (inline in a Serve config, or a YAML/JSON file)::

    steps: [1, 5, 25, 50, 100]     # canary percent of tenants, in order
    hold_s: 600                    # time at each step before the next (if healthy)
    window_s: 300                  # samples older than this are forgotten
    evaluation_interval_s: 10      # how often the rules are checked
    min_samples: 20                # a metric is judged only on at least this many samples
    min_requests_per_step: 20      # canary requests a step must see before promotion
    slo:
      - {metric: error_rate, max: 0.02, for_s: 180}
      - {metric: ttft_p95_ms, max: 800, for_s: 300}

A rule is breached while the canary's value over the window is above ``max``; held for
``for_s`` it rolls the canary back. Every bad field is a ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

# metric name -> (sample kind, quantile or None). Latencies are judged in milliseconds.
METRICS: dict[str, tuple[str, float | None]] = {
    "error_rate": ("error", None),
    "ttft_p95_ms": ("ttft", 0.95),
    "ttft_p99_ms": ("ttft", 0.99),
    "tpot_p95_ms": ("tpot", 0.95),
    "tpot_p99_ms": ("tpot", 0.99),
    "e2e_p95_ms": ("e2e", 0.95),
    "e2e_p99_ms": ("e2e", 0.99),
}


@dataclass(frozen=True)
class SLORule:
    metric: str
    max: float
    for_s: float

    @property
    def kind(self) -> str:
        return METRICS[self.metric][0]

    @property
    def quantile(self) -> float | None:
        return METRICS[self.metric][1]

    def as_dict(self) -> dict:
        return {"metric": self.metric, "max": self.max, "for_s": self.for_s}


# The founding example: a 5xx rate over 2% for 3 minutes, or p95 latency over 800 ms for 5.
DEFAULT_SLO = (SLORule("error_rate", 0.02, 180.0), SLORule("ttft_p95_ms", 800.0, 300.0))


@dataclass(frozen=True)
class RolloutSpec:
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)
    hold_s: float = 600.0
    window_s: float = 300.0
    evaluation_interval_s: float = 10.0
    min_samples: int = 20
    # Promotion needs evidence: a step that saw too few canary requests is held longer.
    min_requests_per_step: int = 20
    slo: tuple[SLORule, ...] = field(default=DEFAULT_SLO)

    def as_dict(self) -> dict:
        return {"steps": list(self.steps), "hold_s": self.hold_s, "window_s": self.window_s,
                "evaluation_interval_s": self.evaluation_interval_s, "min_samples": self.min_samples,
                "min_requests_per_step": self.min_requests_per_step, "slo": [r.as_dict() for r in self.slo]}


_FIELDS = set(RolloutSpec.__dataclass_fields__)


def _number(raw: Mapping, name: str, default: float, *, positive: bool = False, where: str = "rollout") -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}.{name}: must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{where}.{name}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _count(raw: Mapping, name: str, default: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"rollout.{name}: must be an integer >= 0, got {value!r}")
    return value


def _rule(raw, i: int) -> SLORule:
    where = f"rollout.slo[{i}]"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a mapping with metric, max and for_s, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"metric", "max", "for_s"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
    metric = raw.get("metric")
    if metric not in METRICS:
        raise ValueError(f"{where}.metric: must be one of {', '.join(METRICS)}, got {metric!r}")
    if "max" not in raw:
        raise ValueError(f"{where}.max: required")
    limit = _number(raw, "max", 0.0, where=where)
    if metric == "error_rate" and limit >= 1:
        raise ValueError(f"{where}.max: an error rate is a fraction in [0, 1), got {limit}")
    return SLORule(metric, limit, _number(raw, "for_s", 0.0, where=where))


def parse_spec(raw: Mapping | None) -> RolloutSpec:
    """The spec from a mapping (missing fields take the defaults)."""
    if raw is None:
        return RolloutSpec()
    if not isinstance(raw, Mapping):
        raise ValueError(f"rollout: must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(map(str, raw)) - _FIELDS)
    if unknown:
        raise ValueError(f"rollout: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}")
    default = RolloutSpec()
    steps = raw.get("steps", list(default.steps))
    if not isinstance(steps, (list, tuple)) or not steps:
        raise ValueError("rollout.steps: must be a non-empty list of percents")
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 100:
            raise ValueError(f"rollout.steps: each step is a percent in (0, 100], got {s!r}")
    if list(steps) != sorted(set(steps)):
        raise ValueError(f"rollout.steps: must be strictly increasing, got {list(steps)}")
    if steps[-1] != 100:
        raise ValueError(f"rollout.steps: the last step must be 100 (full promotion), got {steps[-1]!r}")
    rules = raw.get("slo", None)
    if rules is None:
        slo = default.slo
    elif isinstance(rules, (list, tuple)):
        slo = tuple(_rule(r, i) for i, r in enumerate(rules))
    else:
        raise ValueError("rollout.slo: must be a list of rules")
    if len({r.metric for r in slo}) != len(slo):
        raise ValueError("rollout.slo: a metric may have one rule only")
    spec = RolloutSpec(
        steps=tuple(float(s) for s in steps),
        hold_s=_number(raw, "hold_s", default.hold_s),
        window_s=_number(raw, "window_s", default.window_s, positive=True),
        evaluation_interval_s=_number(raw, "evaluation_interval_s", default.evaluation_interval_s, positive=True),
        min_samples=max(1, _count(raw, "min_samples", default.min_samples)),
        min_requests_per_step=_count(raw, "min_requests_per_step", default.min_requests_per_step),
        slo=slo,
    )
    return spec


def load_spec(source: Mapping | str | None) -> RolloutSpec:
    """A spec given inline (a mapping, or a JSON/YAML document in a string) or as a file path."""
    if source is None or isinstance(source, Mapping):
        return parse_spec(source)
    if not isinstance(source, str):
        raise ValueError(f"rollout: a mapping or a file path, got {type(source).__name__}")
    text = source
    if os.path.isfile(source):
        with open(source) as f:
            text = f.read()
    try:
        raw = json.loads(text)
    except ValueError:
        try:
            import yaml  # comes with ray, whose extra this package belongs to
        except ImportError:
            raise ValueError("rollout: not JSON, and PyYAML is not installed to read YAML") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"rollout: not valid JSON or YAML: {e}") from None
    if isinstance(raw, str):  # a lone word parses as a YAML string: most likely a missing file
        raise ValueError(f"rollout: {source!r} is neither a file nor a mapping")
    return parse_spec(raw)
