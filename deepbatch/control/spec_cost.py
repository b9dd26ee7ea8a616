"""How many drafts a step should run: speculative decoding's cost model.

A draft costs a step one more token through the model and gains one output token only if it is
accepted. Where a step's time barely depends on its tokens (small batches on a GPU: reading the
weights dominates), every draft is nearly free; where it grows with them (a large batch, the GPU's
compute full), a draft that is accepted rarely costs more than it gains. Before each step, with
the drafts proposed, this chooses the cap ``k`` on drafts per request that maximizes the expected
output tokens per second:

    (decoding + sum_r E[accepted | min(k, len_r) drafts]) / t(decoding + sum_r min(k, len_r), seqs)

``t`` is the step time fitted from the engine's own steps (``step_time.py``: ``a + b * tokens +
c * seqs``); ``E[accepted | m drafts]`` is the sum over positions ``j < m`` of the measured
probability that draft ``j`` is accepted (it needs every draft before it accepted too), counted
from the recent steps with a decay so that a change of workload shows within about a hundred
steps. ``k = 0`` (no drafts) is chosen when nothing beats the step without them; one step in
``EXPLORE_EVERY`` runs the drafts anyway, so the acceptance stays measured while speculation is
off. Until the fit has enough steps, every draft runs. Prefill chunks sharing the step are left
out of ``t``'s tokens, which makes drafts look dearer than they are: the model errs towards
turning speculation off.
"""

from __future__ import annotations

from deepbatch.control.step_time import StepTimeFit

# A drafting step every this many steps while the model says no, to keep measuring acceptance.
EXPLORE_EVERY = 32
# Weight of the older counts at each step: about 1 / (1 - DECAY) steps are remembered.
DECAY = 0.99
# Before any draft at a position was seen: one accepted in two drafted.
PRIOR_ACCEPTED, PRIOR_DRAFTED = 0.5, 1.0


class SpecCostModel:
    def __init__(self, max_drafts: int, fit: StepTimeFit | None = None):
        self.max_drafts = max_drafts
        self.fit = fit if fit is not None else StepTimeFit()
        self.drafted = [0.0] * max_drafts  # decayed drafts that reached position j
        self.accepted = [0.0] * max_drafts  # decayed of those, the accepted ones
        self._seen = ([0] * max_drafts, [0] * max_drafts)  # the engine's cumulative counters, last read
        self.num_steps = 0
        self.last_cap: int | None = None  # for the tests and the logs

    # -- measurements ----------------------------------------------------------------------

    def observe_step(self, duration_s: float, num_scheduled_tokens: int, num_seqs: int,
                     drafted_per_position: list[int], accepted_per_position: list[int]) -> None:
        """A committed step: its time and shape, and the engine's cumulative per-position draft
        counters (``EngineStats``)."""
        self.fit.observe(num_scheduled_tokens, num_seqs, duration_s)
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

    # -- the decision --------------------------------------------------------------------------

    def choose_cap(self, draft_lens: list[int], num_decoding: int, num_seqs: int) -> int:
        """The cap on drafts per request for a step whose drafting requests proposed
        ``draft_lens`` drafts, beside ``num_decoding`` requests decoding one token each (those
        included) of ``num_seqs`` running."""
        self.num_steps += 1
        best = self._best_cap(draft_lens, num_decoding, num_seqs)
        if best == 0 and self.num_steps % EXPLORE_EVERY == 0:
            return max(draft_lens, default=0)
        return best

    def wants_drafts(self, num_decoding: int, num_seqs: int) -> bool:
        """Under async scheduling, before the drafts are proposed: whether the next step should
        run drafts (then synchronously; ``choose_cap`` then caps them and counts the step), with
        every decoding request assumed to propose the full count. A step without drafts counts
        towards the next exploring one."""
        lens = [self.max_drafts] * num_decoding
        if (self.num_steps + 1) % EXPLORE_EVERY == 0 or self._best_cap(lens, num_decoding, num_seqs) > 0:
            return num_decoding > 0
        self.num_steps += 1
        return False

    def _best_cap(self, draft_lens: list[int], num_decoding: int, num_seqs: int) -> int:
        longest = max(draft_lens, default=0)
        coeffs = self.fit.fit()
        if coeffs is None or not longest:
            return longest
        gained = [0.0]
        for p in self.acceptance():
            gained.append(gained[-1] + p)
        best, best_rate = 0, num_decoding / coeffs.predict(num_decoding, num_seqs)
        for k in range(1, longest + 1):
            extra = sum(min(k, n) for n in draft_lens)
            gain = sum(gained[min(k, n, self.max_drafts)] for n in draft_lens)
            rate = (num_decoding + gain) / coeffs.predict(num_decoding + extra, num_seqs)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def limit(self, running: list) -> None:
        """Cut every running request's ``spec_token_ids`` to the cap chosen for this step."""
        lens = [len(r.spec_token_ids) for r in running if r.spec_token_ids]
        if not lens:
            return
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        self.last_cap = cap = self.choose_cap(lens, decoding, len(running))
        for r in running:
            del r.spec_token_ids[cap:]


def _new(count: int, last: int) -> int:
    return count - last if count >= last else count
