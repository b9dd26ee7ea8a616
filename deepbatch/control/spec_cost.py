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
draft before it): the engine-wide figure per position, counted over about the last twenty steps
that drafted (steps without drafts leave it as it is: where drafts rarely run, what they showed
must outweigh the prior), moved towards the request's own record as it drafts (a request that
copies its prompt keeps drafting beside one that never does).
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

import numpy as np

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
# Weight of the older step times at each drafting step: about 1 / (1 - DECAY) are remembered.
DECAY = 0.99
# Weight of the older acceptance counts at each drafting step: about the last 20 of them count.
ACCEPTANCE_DECAY = 0.95
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
        self._learning_drafts = False  # under async scheduling: whether the last learning step drafted
        self._arm: str | None = None  # wants_drafts's choice for the step choose_caps caps: all | best
        self.last_caps: list[int] | None = None  # the last step's, for the tests
        # The fits change only when a step is observed; between two observations a step asks for
        # its prices twice (``wants_drafts``, then ``choose_caps``): solved once.
        self._observed = 0
        self._plain_memo: tuple[int, StepTimeCoeffs | None] | None = None

    # -- measurements ----------------------------------------------------------------------

    def observe_step(self, duration_s: float, num_scheduled_tokens: int, num_seqs: int,
                     drafted_per_position: list[int], accepted_per_position: list[int], num_drafts: int = 0,
                     drafting_arm: bool = False) -> None:
        """A committed step: its time and shape (``num_drafts`` of its tokens were drafts), and
        the engine's cumulative per-position draft counters (``EngineStats``). ``drafting_arm``:
        under async scheduling, the step was run for drafts (proposed, synchronous) even if none
        were left to run; its time is a drafting step's, with no drafts, never a plain step's."""
        self._observed += 1
        if num_drafts == 0 and not drafting_arm:
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
        k = self.max_drafts
        drafted = [drafted_per_position[j] if j < len(drafted_per_position) else 0 for j in range(k)]
        accepted = [accepted_per_position[j] if j < len(accepted_per_position) else 0 for j in range(k)]
        # A counter below its last reading was reset (a fresh EngineStats): all of it is new.
        new_drafted = [_new(d, seen) for d, seen in zip(drafted, self._seen[0])]
        new_accepted = [_new(a, seen) for a, seen in zip(accepted, self._seen[1])]
        self._seen = (drafted, accepted)
        # The counts age with each step that drafted, not with the steps between: where drafts
        # rarely run, the few that do still outweigh the prior.
        if any(new_drafted):
            self.drafted = [ACCEPTANCE_DECAY * v + d for v, d in zip(self.drafted, new_drafted)]
            self.accepted = [ACCEPTANCE_DECAY * v + a for v, a in zip(self.accepted, new_accepted)]

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
        if self._plain_memo is not None and self._plain_memo[0] == self._observed:
            return self._plain_memo[1]
        coeffs = self.fit.fit()
        if coeffs is None and len(self.fit.steps) >= self.fit.min_steps:
            coeffs = StepTimeCoeffs(self.fit.mean_duration(), 0.0, 0.0)
        self._plain_memo = (self._observed, coeffs)
        return coeffs

    def _prices(self, num_decoding: int, num_seqs: int):
        """(plain step seconds, d0, d1), or None while either fit is missing."""
        coeffs = self._plain_fit()
        cost = self.draft_cost(coeffs.b) if coeffs is not None else None
        if cost is None:
            return None
        return max(coeffs.predict(num_decoding, num_seqs), 1e-9), *cost  # a fit pinned at 0 divides too

    def _decide(self, probs: np.ndarray, counts: np.ndarray | int, num_decoding: int, prices) -> int:
        """The best count of positions, taken in falling acceptance ``probs`` (``counts[i]``
        positions of probability ``probs[i]``; 0: no drafts); sets ``explore_every`` from what a
        step of the other arm would lose. Within a run of one probability the rate moves one
        way, so the best count ends a run."""
        t0, d0, d1 = prices
        n = np.cumsum(np.broadcast_to(counts, probs.shape))
        gain = num_decoding + np.cumsum(probs * counts)
        rate = gain / (t0 + d0 + d1 * n)
        best, best_n = num_decoding / t0, 0
        if len(rate) and rate.max() > best:
            i = int(rate.argmax())
            best, best_n = float(rate[i]), int(n[i])
        # The other arm's step: its seconds beyond what its tokens take at the best rate.
        all_n, all_gain = (int(n[-1]), float(gain[-1])) if len(n) else (0, float(num_decoding))
        other_t, other_gain = (t0, num_decoding) if best_n else (t0 + d0 + d1 * all_n, all_gain)
        lost = max(0.0, other_t - other_gain / best) / (t0 + d0 + d1 * best_n if best_n else t0)
        self.explore_every = min(MAX_EXPLORE_EVERY, max(EXPLORE_EVERY, math.ceil(lost / EXPLORE_BUDGET)))
        return best_n

    def wants_drafts(self, num_decoding: int, num_seqs: int, requests: list | None = None) -> bool:
        """Under async scheduling, before the drafts are proposed: which arm the next step takes,
        with every decoding request (``requests``; without them, ``num_decoding`` of them at the
        engine-wide acceptance) drafting all it may, at the acceptance ``choose_caps`` will judge
        its drafts by (so the two agree: a step run for drafts that then keeps none is
        synchronous for nothing). A drafting step runs
        synchronously (``choose_caps`` then caps it, as decided here); a plain one stays
        asynchronous, and so is measured as the engine runs it: the learning steps without drafts
        and the exploring ones are asynchronous plain steps too."""
        if num_decoding == 0:
            return False
        prices = self._prices(num_decoding, num_seqs)
        if prices is None:  # learning both step times: every draft, then a plain step
            self._learning_drafts = not self._learning_drafts
            draft, arm = self._learning_drafts, "all"
        else:
            wide = np.asarray(self.acceptance())
            if requests:  # each request's positions, in falling probability
                probs = np.sort(self._acceptance_rows(requests, wide).ravel())[::-1]
                pays = self._decide(probs, 1, num_decoding, prices) > 0
            else:  # positions of one index share a probability
                pays = self._decide(wide, num_decoding, num_decoding, prices) > 0
            self._since_explore += 1
            explore = self._since_explore >= self.explore_every
            if explore:
                self._since_explore = 0
            draft, arm = pays != explore, "all" if explore else "best"
        self._arm = arm if draft else None
        if not draft:
            self.num_steps += 1
        return draft

    def request_acceptance(self, r, engine_wide: list[float] | None = None) -> list[float]:
        """Per position j, the probability that request ``r``'s draft j is accepted: its own
        counts (``Request.spec_drafted``, ``spec_accepted``) with the engine-wide figure
        (``acceptance()``, or ``engine_wide`` when the caller has it) weighing as
        ``REQUEST_PRIOR`` drafts, so a request's first drafts are judged by everyone's and a
        request that copies (or never does) soon by its own. Never rising with j."""
        wide = np.asarray(engine_wide if engine_wide is not None else self.acceptance())
        return self._acceptance_rows([r], wide)[0].tolist()

    def _acceptance_rows(self, requests: list, engine_wide: np.ndarray) -> np.ndarray:
        """``request_acceptance`` of each request, as rows of one array."""
        k = self.max_drafts
        pad = [0] * k
        # Rows padded in Python and converted once: per-row numpy writes cost more at batch 256.
        drafted = np.array([(r.spec_drafted + pad)[:k] if r.spec_drafted else pad for r in requests],
                           dtype=np.float64).reshape(len(requests), k)
        accepted = np.array([(r.spec_accepted + pad)[:k] if r.spec_drafted else pad for r in requests],
                            dtype=np.float64).reshape(len(requests), k)
        p = (accepted + REQUEST_PRIOR * engine_wide) / (drafted + REQUEST_PRIOR)
        return np.minimum.accumulate(p, axis=1)

    def choose_caps(self, acceptance, draft_lens: list[int], num_decoding: int, num_seqs: int) -> list[int]:
        """Each drafting request's cap, from its acceptance per position (a row each; a list of
        lists or an array) and its proposed count: of every count of positions taken in falling
        probability (none included), the one with the most expected output tokens per second.
        Under async scheduling the arm was chosen by ``wants_drafts``; otherwise it is chosen here
        (learning, and exploring now and then)."""
        self.num_steps += 1
        arm, self._arm = self._arm, None
        if arm == "all":  # learning or exploring the drafting arm
            return list(draft_lens)
        prices = self._prices(num_decoding, num_seqs)
        if prices is None:  # learning both step times: every draft, then none
            return list(draft_lens) if self.num_steps % 2 else [0] * len(draft_lens)
        lens = np.asarray(draft_lens)
        if isinstance(acceptance, np.ndarray):  # from limit(): one row per request already
            p = acceptance.astype(np.float64, copy=True)
        else:
            width = max(len(row) for row in acceptance) if len(acceptance) else 0
            p = np.zeros((len(draft_lens), width))
            for i, row in enumerate(acceptance):
                p[i, :len(row)] = row
        width = p.shape[1]
        p[np.arange(width)[None, :] >= lens[:, None]] = -1.0  # positions not drafted
        flat = p.ravel()
        # Falling probability; a request's positions in order where they tie.
        order = np.lexsort((np.tile(np.arange(width), len(draft_lens)), -flat))
        order = order[flat[order] >= 0]
        best_n = self._decide(flat[order], 1, num_decoding, prices)
        if arm is None:  # a synchronous engine: the other arm now and then, to keep it measured
            self._since_explore += 1
            if self._since_explore >= self.explore_every:
                self._since_explore = 0
                return [0] * len(draft_lens) if best_n else list(draft_lens)
        # A request's positions come in order: its probabilities fall.
        caps = np.bincount(order[:best_n] // max(width, 1), minlength=len(draft_lens))
        return caps.tolist()

    def limit(self, running: list) -> None:
        """Cut each running request's ``spec_token_ids`` to the cap chosen for it this step."""
        drafting = [r for r in running if r.spec_token_ids]
        if not drafting:
            self._arm = None
            return
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        rows = self._acceptance_rows(drafting, np.asarray(self.acceptance()))
        self.last_caps = self.choose_caps(rows, [len(r.spec_token_ids) for r in drafting], decoding, len(running))
        for r, cap in zip(drafting, self.last_caps):
            del r.spec_token_ids[cap:]


def _new(count: int, last: int) -> int:
    return count - last if count >= last else count
