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
from collections import Counter, deque

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
        of the prior ``c = 0``, in units of one average step.

        The normal equations' sums are kept up to date as steps come and go, so a fit costs the
        same at any window size: it runs on the engine thread between two steps, where a pass
        over the window would show up as a late token."""
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.min_steps = min_steps
        self.ridge = ridge
        # Plain floats, not numpy: updated at every step, where numpy's per-call cost would be
        # most of the time.
        self._xtx = [[0.0] * 3 for _ in range(3)]  # sum of x x^T over the window, x = (1, tokens, seqs)
        self._xty = [0.0] * 3  # sum of x * duration
        self.num_mixed = 0  # steps where tokens and sequences differ: the only ones that separate b from c
        self._token_counts: Counter[int] = Counter()
        self._since_resum = 0

    def observe(self, num_batched_tokens: int, num_seqs: int, duration_s: float) -> None:
        if not (num_batched_tokens > 0 and num_seqs > 0 and math.isfinite(duration_s) and duration_s > 0):
            return
        if len(self.steps) == self.steps.maxlen:
            self._account(*self.steps[0], sign=-1.0)
        self.steps.append((num_batched_tokens, num_seqs, duration_s))
        self._account(num_batched_tokens, num_seqs, duration_s, sign=1.0)
        self._since_resum += 1
        if self._since_resum >= (self.steps.maxlen or 4096):
            self._resum()  # adding and removing leaves rounding behind; start again from the window

    def _account(self, tokens: int, seqs: int, duration: float, sign: float) -> None:
        x = (1.0, float(tokens), float(seqs))
        for i in range(3):
            row = self._xtx[i]
            for j in range(3):
                row[j] += sign * x[i] * x[j]
            self._xty[i] += sign * duration * x[i]
        self.num_mixed += int(sign) * (tokens != seqs)
        self._token_counts[tokens] += int(sign)
        if not self._token_counts[tokens]:
            del self._token_counts[tokens]

    def _resum(self) -> None:
        data = np.asarray(self.steps, dtype=np.float64).reshape(-1, 3)
        x = np.column_stack((np.ones(len(data)), data[:, 0], data[:, 1]))
        self._xtx, self._xty = (x.T @ x).tolist(), (x.T @ data[:, 2]).tolist()
        self._since_resum = 0

    def mean_duration(self) -> float | None:
        """The mean time of the steps in the window (None without any)."""
        return self._xty[0] / self._xtx[0][0] if self.steps else None

    def fit(self) -> StepTimeCoeffs | None:
        if len(self.steps) < self.min_steps:
            return None
        if len(self._token_counts) == 1 and self.num_mixed == 0:
            return None  # one shape only: the intercept and the slope are not separable
        free = [0, 1, 2]
        # Active set for non-negativity: at most three refits.
        while free:
            theta = _ridge_solve(self._xtx, self._xty, len(self.steps), free, self.ridge)
            if theta is None:
                return None
            negative = [i for i in free if theta[i] < 0]
            if not negative:
                return StepTimeCoeffs(*theta)
            free.remove(min(negative, key=lambda i: theta[i]))
        return None


def _ridge_solve(xtx: list[list[float]], xty: list[float], n: int, free: list[int], ridge: float) -> list[float] | None:
    """Least squares over the ``free`` columns (the others are 0) from the normal equations, with
    ``ridge`` times the mean square of column 2 added to its diagonal (the prior ``c = 0``) and a
    tiny relative ridge on every column so that a column that is constant or repeats another
    cannot make the system singular. At most 3 x 3, solved in plain floats: it runs between two
    steps, where numpy's per-call cost (tens of microseconds a solve) would be most of the time."""
    m = [[xtx[i][j] for j in free] for i in free]
    v = [float(xty[i]) for i in free]
    for i, ci in enumerate(free):
        d = m[i][i]
        m[i][i] += 1e-9 * d + 1e-30 + (ridge * d / n if ci == 2 else 0.0)
    sol = _gauss_solve(m, v)
    if sol is None or not all(math.isfinite(x) for x in sol):
        return None
    theta = [0.0, 0.0, 0.0]
    for i, ci in enumerate(free):
        theta[ci] = sol[i]
    return theta


def _gauss_solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` by Gaussian elimination with partial pivoting (``m``, ``v`` are overwritten);
    None where ``m`` is singular."""
    size = len(v)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(m[r][col]))
        if m[pivot][col] == 0.0:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        v[col], v[pivot] = v[pivot], v[col]
        for r in range(col + 1, size):
            f = m[r][col] / m[col][col]
            for c in range(col, size):
                m[r][c] -= f * m[col][c]
            v[r] -= f * v[col]
    x = [0.0] * size
    for r in range(size - 1, -1, -1):
        x[r] = (v[r] - sum(m[r][c] * x[c] for c in range(r + 1, size))) / m[r][r]
    return x
