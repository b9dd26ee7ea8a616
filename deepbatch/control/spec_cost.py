"""How many drafts a step should run: speculative decoding's cost model.

A draft costs a step one more token through the model and gains one output token only if it is
accepted; and a step that runs drafts at all costs more than its tokens say: it is synchronous
(no overlap with the host's work for the next step), its sampler draws the draft rows, its
proposer ran first. On a GPU at batch 1 the tokens cost almost nothing and that fixed part is
most of a drafting step's price. So the model measures both rather than assume them:

    t_plain = a + b * tokens + c * seqs          fitted on steps without drafts (``step_time.py``)
    t_draft = t_plain + d0 + d1 * drafts         d0, d1 fitted on drafting steps' excess over t_plain

Before each step, with the drafts proposed, it chooses each request's cap to maximize the step's
expected output tokens per second, ``(decoding + sum of the chosen positions' acceptance) / t``.
A position's acceptance is the probability that the request's draft there is accepted (with every
draft before it): the engine-wide figure per position, counted over the recent steps with a decay
so that a change of workload shows within about a hundred steps, moved towards the request's own
record as it drafts (a request that copies its prompt keeps drafting beside one that never does).
With a fixed cost and a cost per position, the best set of n positions is the n likeliest, so the
model evaluates every count n of positions taken in falling acceptance and keeps the best, none
included. Both kinds of step stay measured: where no draft pays, a step now and then runs every
draft anyway (the acceptance); where drafts pay, a step now and then runs without (the plain step
time). Such a step costs throughput, the more the worse its arm (at saturation a step of every
draft takes several plain steps' time and gains nothing), so the model spaces them to lose at
most ``EXPLORE_BUDGET`` of the throughput: one step in ``EXPLORE_EVERY`` where exploring is cheap,
up to one in ``MAX_EXPLORE_EVERY``. Until both fits exist, steps alternate between every draft and
none.
Prefill chunks sharing a step are left out of the tokens the decision counts, which makes drafts
look dearer than they are: the model errs towards turning speculation off.
"""

from __future__ import annotations

import math
from collections import deque

from deepbatch.control.step_time import StepTimeCoeffs, StepTimeFit

# Now and then the kind of step the model did not choose (with drafts, or without), so that the
# acceptance and both step times stay measured: at most this share of the throughput lost to it,
# one such step in EXPLORE_EVERY at the most often and in MAX_EXPLORE_EVERY at the least (a
# change of workload still shows within that many steps).
EXPLORE_BUDGET = 0.01
EXPLORE_EVERY = 32
MAX_EXPLORE_EVERY = 512
# Steps of each kind measured before the model decides (until then the two alternate).
MIN_PLAIN_STEPS = 8
MIN_DRAFT_STEPS = 8
# Weight of the older counts at each step: about 1 / (1 - DECAY) steps are remembered.
DECAY = 0.99
# Before any draft at a position was seen: one accepted in two drafted.
PRIOR_ACCEPTED, PRIOR_DRAFTED = 0.5, 1.0
# How many drafts the engine-wide acceptance weighs against one request's own.
REQUEST_PRIOR = 4.0


class SpecCostModel:
    def __init__(self, max_drafts: int, fit: StepTimeFit | None = None):
        self.max_drafts = max_drafts
        # Steps without drafts; a few suffice, the decision is made at the steps' own shapes.
        self.fit = fit if fit is not None else StepTimeFit(min_steps=MIN_PLAIN_STEPS)
        self.drafted = [0.0] * max_drafts  # decayed drafts that reached position j
        self.accepted = [0.0] * max_drafts  # decayed of those, the accepted ones
        self._seen = ([0] * max_drafts, [0] * max_drafts)  # the engine's cumulative counters, last read
        # Decayed sums over drafting steps of (1, n, n^2, e, n e): n drafts, e seconds over t_plain.
        self._excess = [0.0] * 5
        # Drafting steps seen before the plain fit existed, measured against it once it does.
        self._unmeasured: deque[tuple[int, int, float, int]] = deque(maxlen=64)
        self.num_drafting_steps = 0
        self.num_steps = 0
        self.explore_every = EXPLORE_EVERY  # set at each decision by what exploring would cost
        self._since_explore = 0
        self.last_caps: list[int] | None = None  # the last step's, for the tests

    # -- measurements ----------------------------------------------------------------------

    def observe_step(self, duration_s: float, num_scheduled_tokens: int, num_seqs: int,
                     drafted_per_position: list[int], accepted_per_position: list[int], num_drafts: int = 0) -> None:
        """A committed step: its time and shape (``num_drafts`` of its tokens were drafts), and
        the engine's cumulative per-position draft counters (``EngineStats``)."""
        if num_drafts == 0:
            self.fit.observe(num_scheduled_tokens, num_seqs, duration_s)
        else:
            self.num_drafting_steps += 1
            self._unmeasured.append((num_scheduled_tokens, num_seqs, duration_s, num_drafts))
            if (coeffs := self._plain_fit()) is not None:
                x = self._excess
                while self._unmeasured:
                    tokens, seqs, seconds, n = self._unmeasured.popleft()
                    e = seconds - coeffs.predict(tokens - n, seqs)
                    x[:] = [DECAY * v + d for v, d in zip(x, (1.0, n, n * n, e, n * e))]
        for j in range(self.max_drafts):
            drafted = drafted_per_position[j] if j < len(drafted_per_position) else 0
            accepted = accepted_per_position[j] if j < len(accepted_per_position) else 0
            # A counter below its last reading was reset (a fresh EngineStats): all of it is new.
            self.drafted[j] = DECAY * self.drafted[j] + _new(drafted, self._seen[0][j])
            self.accepted[j] = DECAY * self.accepted[j] + _new(accepted, self._seen[1][j])
            self._seen[0][j], self._seen[1][j] = drafted, accepted

    def acceptance(self) -> list[float]:
        """Per position j, the probability that a draft reaching it is accepted (with the drafts
        before it)."""
        return [(a + PRIOR_ACCEPTED) / (d + PRIOR_DRAFTED) for a, d in zip(self.accepted, self.drafted)]

    def draft_cost(self, seconds_per_token: float) -> tuple[float, float] | None:
        """``(d0, d1)``: what a drafting step costs over a plain one of its other tokens, fixed and
        per draft, both >= 0; None until ``MIN_DRAFT_STEPS`` drafting steps were measured. Where
        every drafting step ran the same number of drafts only their sum is known, and a draft is
        charged ``seconds_per_token`` (the plain fit's)."""
        w, sn, snn, se, sne = self._excess
        if w < (1 - DECAY ** MIN_DRAFT_STEPS) / (1 - DECAY) - 1e-9:  # the decayed weight of that many
            return None
        mean_n, mean_e = sn / w, se / w
        var = snn / w - mean_n * mean_n
        d1 = max(0.0, (sne / w - mean_n * mean_e) / var) if var > 1e-6 * max(mean_n * mean_n, 1.0) \
            else seconds_per_token
        return max(0.0, mean_e - d1 * mean_n), d1

    # -- the decision --------------------------------------------------------------------------

    def _plain_fit(self) -> StepTimeCoeffs | None:
        """The plain steps' fit; where they all had one shape (a steady batch of decodes) and
        none can be fitted, their mean time, which is what a step of that shape takes."""
        coeffs = self.fit.fit()
        if coeffs is None and len(self.fit.steps) >= self.fit.min_steps:
            coeffs = StepTimeCoeffs(self.fit.mean_duration(), 0.0, 0.0)
        return coeffs

    def _prices(self, num_decoding: int, num_seqs: int):
        """(plain step seconds, d0, d1), or None while either fit is missing."""
        coeffs = self._plain_fit()
        cost = self.draft_cost(coeffs.b) if coeffs is not None else None
        if cost is None:
            return None
        return max(coeffs.predict(num_decoding, num_seqs), 1e-9), *cost  # a fit pinned at 0 divides too

    def _decide(self, runs, num_decoding: int, prices) -> int:
        """The best count of positions, taken from ``runs`` of ``(acceptance, count)`` in falling
        acceptance (0: no drafts); sets ``explore_every`` from what a step of the other arm would
        lose. Within a run the rate moves one way, so the best count ends a run."""
        t0, d0, d1 = prices
        gain, best, best_n, n = float(num_decoding), num_decoding / t0, 0, 0
        for p, count in runs:
            gain, n = gain + p * count, n + count
            if gain / (t0 + d0 + d1 * n) > best:
                best, best_n = gain / (t0 + d0 + d1 * n), n
        # The other arm's step: its seconds beyond what its tokens take at the best rate.
        other_t, other_gain = (t0, num_decoding) if best_n else (t0 + d0 + d1 * n, gain)
        lost = max(0.0, other_t - other_gain / best) / (t0 + d0 + d1 * best_n if best_n else t0)
        self.explore_every = min(MAX_EXPLORE_EVERY, max(EXPLORE_EVERY, math.ceil(lost / EXPLORE_BUDGET)))
        return best_n

    def wants_drafts(self, num_decoding: int, num_seqs: int) -> bool:
        """Under async scheduling, before the drafts are proposed: whether the next step should
        run drafts (then synchronously; ``choose_caps`` then caps them and counts the step), at
        the engine-wide acceptance with every decoding request drafting. A step without drafts
        counts towards the next exploring one."""
        if num_decoding == 0:
            return False
        prices = self._prices(num_decoding, num_seqs)
        if prices is None:
            return True
        # Positions of one index share a probability.
        pays = self._decide([(p, num_decoding) for p in self.acceptance()], num_decoding, prices) > 0
        if pays or self._since_explore + 1 >= self.explore_every:
            return True
        self.num_steps += 1
        self._since_explore += 1
        return False

    def request_acceptance(self, r, engine_wide: list[float] | None = None) -> list[float]:
        """Per position j, the probability that request ``r``'s draft j is accepted: its own
        counts (``Request.spec_drafted``, ``spec_accepted``) with the engine-wide figure
        (``acceptance()``, or ``engine_wide`` when the caller has it) weighing as
        ``REQUEST_PRIOR`` drafts, so a request's first drafts are judged by everyone's and a
        request that copies (or never does) soon by its own. Never rising with j."""
        out, last = [], 1.0
        for j, p in enumerate(engine_wide if engine_wide is not None else self.acceptance()):
            drafted = r.spec_drafted[j] if j < len(r.spec_drafted) else 0
            accepted = r.spec_accepted[j] if j < len(r.spec_accepted) else 0
            last = min(last, (accepted + REQUEST_PRIOR * p) / (drafted + REQUEST_PRIOR))
            out.append(last)
        return out

    def choose_caps(self, acceptance: list[list[float]], draft_lens: list[int], num_decoding: int,
                    num_seqs: int) -> list[int]:
        """Each drafting request's cap, from its acceptance per position and its proposed count:
        of every count of positions taken in falling probability (none included), the one with
        the most expected output tokens per second."""
        self.num_steps += 1
        prices = self._prices(num_decoding, num_seqs)
        if prices is None:  # learning both step times: every draft, then none
            return list(draft_lens) if self.num_steps % 2 else [0] * len(draft_lens)
        positions = sorted(((p[j], j, i) for i, (p, n) in enumerate(zip(acceptance, draft_lens))
                            for j in range(min(n, len(p)))), key=lambda x: (-x[0], x[1]))
        best_n = self._decide([(q, 1) for q, _, _ in positions], num_decoding, prices)
        self._since_explore += 1
        if self._since_explore >= self.explore_every:  # the arm not taken, to keep it measured
            self._since_explore = 0
            return [0] * len(draft_lens) if best_n else list(draft_lens)
        caps = [0] * len(draft_lens)
        for _, _, i in positions[:best_n]:  # a request's positions come in order: its probabilities fall
            caps[i] += 1
        return caps

    def limit(self, running: list) -> None:
        """Cut each running request's ``spec_token_ids`` to the cap chosen for it this step."""
        drafting = [r for r in running if r.spec_token_ids]
        if not drafting:
            return
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        engine_wide = self.acceptance()
        self.last_caps = self.choose_caps([self.request_acceptance(r, engine_wide) for r in drafting],
                                          [len(r.spec_token_ids) for r in drafting], decoding, len(running))
        for r, cap in zip(drafting, self.last_caps):
            del r.spec_token_ids[cap:]


def _new(count: int, last: int) -> int:
    return count - last if count >= last else count
