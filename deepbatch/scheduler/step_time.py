"""Step time as a function of the step's shape: ``t = a + b * batched_tokens + c * num_seqs``.

``a`` is the fixed cost of a step (launches, the host side, weights read once), ``b`` the cost of
one token through the layers, ``c`` the extra cost of one more sequence (its attention over its
own context, sampling, metadata). The SLO controller predicts latency from it.

The fit is least squares over a sliding window of measured steps, with two guards:

- In decode-only steps every sequence is one token, so ``batched_tokens == num_seqs`` and only
  ``b + c`` is identified. A ridge penalty on ``c`` alone picks, along that unidentified line,
  the point with ``c = 0``: the whole per-sequence cost is charged to tokens, which over-predicts
  prefill (conservative for latency) and predicts decode exactly. Steps that mix prefill chunks
  with decodes separate the two, and then the data outweighs the penalty (it is worth one
  average step).
- Coefficients are never negative: a negative one (noise, too few distinct shapes) is pinned at 0
  and the rest refitted. Too few steps, or steps of one shape only, give no fit (``None``).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimeCoeffs:
    """Seconds: ``a`` per step, ``b`` per batched token, ``c`` per scheduled sequence."""

    a: float
    b: float
    c: float

    def predict(self, num_batched_tokens: float, num_seqs: float) -> float:
        return self.a + self.b * num_batched_tokens + self.c * num_seqs


class StepTimeFit:
    def __init__(self, window: int = 2048, min_steps: int = 32, ridge: float = 1.0):
        """``window``: most recent steps kept; ``min_steps``: fewer give no fit; ``ridge``: weight
        of the prior ``c = 0``, in units of one average step."""
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.min_steps = min_steps
        self.ridge = ridge

    def observe(self, num_batched_tokens: int, num_seqs: int, duration_s: float) -> None:
        if num_batched_tokens > 0 and num_seqs > 0 and math.isfinite(duration_s) and duration_s > 0:
            self.steps.append((num_batched_tokens, num_seqs, duration_s))

    @property
    def num_mixed(self) -> int:
        """Steps where tokens and sequences differ: the only ones that separate ``b`` from ``c``."""
        return sum(1 for x, s, _ in self.steps if x != s)

    def fit(self) -> StepTimeCoeffs | None:
        if len(self.steps) < self.min_steps:
            return None
        xs = [float(x) for x, _, _ in self.steps]
        if max(xs) == min(xs) and all(x == s for x, s, _ in self.steps):
            return None  # one shape only: the intercept and the slope are not separable
        rows = [(1.0, float(x), float(s), t) for x, s, t in self.steps]
        free = [0, 1, 2]
        # Active set for non-negativity: at most three refits.
        while free:
            theta = _ridge_solve(rows, free, self.ridge)
            if theta is None:
                return None
            negative = [i for i in free if theta[i] < 0]
            if not negative:
                return StepTimeCoeffs(*theta)
            free.remove(min(negative, key=lambda i: theta[i]))
        return None


def _ridge_solve(rows: list[tuple[float, float, float, float]], free: list[int], ridge: float) -> list[float] | None:
    """Least squares over the ``free`` columns (the others are 0), with ``ridge`` times the mean
    square of column 2 added to its diagonal (the prior ``c = 0``) and a tiny relative ridge on
    every column so that a column that is constant or repeats another cannot make the system
    singular."""
    data = np.asarray(rows, dtype=np.float64)
    x, y = data[:, free], data[:, 3]
    m = x.T @ x
    v = x.T @ y
    diag = np.diag(m).copy()
    m[np.diag_indices_from(m)] += 1e-9 * diag + 1e-30
    if 2 in free:
        i = free.index(2)
        m[i, i] += ridge * diag[i] / len(rows)
    try:
        sol = np.linalg.solve(m, v)
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(sol)):
        return None
    theta = [0.0, 0.0, 0.0]
    for i, ci in enumerate(free):
        theta[ci] = float(sol[i])
    return theta
