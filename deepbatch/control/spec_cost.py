"""How many drafts a step should run: speculative decoding's cost model.

A draft costs a step one more token through the model and gains one output token only if it is
accepted. Where a step's time barely depends on its tokens (small batches on a GPU: reading the
weights dominates), every draft is nearly free; where it grows with them (a large batch, the GPU's
compute full), a draft that is rarely accepted costs more than it gains. Before each step, with
the drafts proposed, this chooses each request's cap to maximize the expected output tokens per
second of the step:

    (decoding + sum of the chosen draft positions' acceptance) / t(decoding + chosen positions, seqs)

``t`` is the step time fitted from the engine's own steps (``step_time.py``: ``a + b * tokens +
c * seqs``), so a position costs ``b``. A position's acceptance is the probability that the
request's draft there is accepted (with every draft before it): the engine-wide figure per
position, counted over the recent steps with a decay so that a change of workload shows within
about a hundred steps, moved towards the request's own record as it drafts (a request that copies
its prompt keeps drafting beside one that never does). The best set of positions is taken in
falling acceptance while each gains more than the step's rate times its cost. No drafts at all
when none pays; one step in ``EXPLORE_EVERY`` runs them anyway, so the acceptance stays measured
while speculation is off. Until the fit has enough steps, every draft runs. Prefill chunks sharing
the step are left out of ``t``'s tokens, which makes drafts look dearer than they are: the model
errs towards turning speculation off.
"""

from __future__ import annotations

from deepbatch.control.step_time import StepTimeFit

# A drafting step every this many steps while the model says no, to keep measuring acceptance.
EXPLORE_EVERY = 32
# Weight of the older counts at each step: about 1 / (1 - DECAY) steps are remembered.
DECAY = 0.99
# Before any draft at a position was seen: one accepted in two drafted.
PRIOR_ACCEPTED, PRIOR_DRAFTED = 0.5, 1.0
# How many drafts the engine-wide acceptance weighs against one request's own.
REQUEST_PRIOR = 4.0


class SpecCostModel:
    def __init__(self, max_drafts: int, fit: StepTimeFit | None = None):
        self.max_drafts = max_drafts
        self.fit = fit if fit is not None else StepTimeFit()
        self.drafted = [0.0] * max_drafts  # decayed drafts that reached position j
        self.accepted = [0.0] * max_drafts  # decayed of those, the accepted ones
        self._seen = ([0] * max_drafts, [0] * max_drafts)  # the engine's cumulative counters, last read
        self.num_steps = 0
        self.last_caps: list[int] | None = None  # the last step's, for the tests

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

    def wants_drafts(self, num_decoding: int, num_seqs: int) -> bool:
        """Under async scheduling, before the drafts are proposed: whether the next step should
        run drafts (then synchronously; ``choose_caps`` then caps them and counts the step). At
        the engine-wide acceptance some draft pays exactly when the likeliest position does, the
        first that ``choose_caps`` would take. A step without drafts counts towards the next
        exploring one."""
        if num_decoding == 0:
            return False
        coeffs = self.fit.fit()
        if (coeffs is None or (self.num_steps + 1) % EXPLORE_EVERY == 0
                or _pays(max(self.acceptance()), float(num_decoding), coeffs.predict(num_decoding, num_seqs),
                         coeffs.b)):
            return True
        self.num_steps += 1
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
        """Each drafting request's cap, from its acceptance per position and its proposed count.
        A draft position costs ``b`` (the fit's seconds per token) and gains its probability of
        being accepted, so the best set takes the positions in falling probability while each
        gains more than the step's tokens per second times what it costs."""
        self.num_steps += 1
        coeffs = self.fit.fit()
        if coeffs is None:
            return list(draft_lens)
        gain, seconds = float(num_decoding), coeffs.predict(num_decoding, num_seqs)
        positions = sorted(((p[j], j, i) for i, (p, n) in enumerate(zip(acceptance, draft_lens))
                            for j in range(min(n, len(p)))), key=lambda x: (-x[0], x[1]))
        caps = [0] * len(draft_lens)
        for q, _, i in positions:  # a request's positions come in order: its probabilities fall
            if not _pays(q, gain, seconds, coeffs.b):
                break
            caps[i] += 1
            gain, seconds = gain + q, seconds + coeffs.b
        if not any(caps) and self.num_steps % EXPLORE_EVERY == 0:
            return list(draft_lens)
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


def _pays(acceptance: float, tokens: float, seconds: float, seconds_per_token: float) -> bool:
    """Whether a draft position accepted with this probability raises a step's expected tokens
    per second (``tokens`` in ``seconds`` so far; the position costs ``seconds_per_token``)."""
    return acceptance * seconds > tokens * seconds_per_token
