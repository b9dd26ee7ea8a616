"""One sequence's position in its grammar.

The matcher follows the request's output tokens; it never owns them. ``advance`` feeds it the
output tokens it has not seen yet, so the same call serves every path a token takes:

    output_token_ids:  [ t0 t1 ... | tk ... tn-1 ] + a pending one
                        seen by the   not yet        the newest token, still on the device
                        matcher       (committed)    (async scheduling): read from the step that
                                                     sampled it, ``last_sample``

- synchronous steps: the engine commits token t, then ``advance`` accepts it;
- async steps: step t+1 is launched before token t is committed; the sampler's ``advance`` reads
  token t from step t's sampled ids (that step precedes the running forward on the device, so the
  wait does not stall it) before it fills step t+1's bitmask; the commit finds it already seen;
- preemption (recompute or swap) keeps a request's output tokens, so the matcher stays valid; if
  the output were ever shorter than what the matcher has seen, it is rebuilt by replaying the
  tokens kept.

With ``start_after_token_ids`` the grammar starts (a fresh matcher) with the token after the first
place that sequence ends in the output; tokens before it are free.
"""

from __future__ import annotations

from deepbatch.structured_output.grammar import CompiledGrammar


class StructuredOutputRequest:
    def __init__(self, grammar: CompiledGrammar, start_after_token_ids: tuple[int, ...] = ()):
        self.grammar = grammar
        self.start_after_token_ids = tuple(start_after_token_ids)
        # Made on the first ``advance``: the async engine validates requests in another thread
        # and drops those copies, so a matcher made at construction would be wasted.
        self.started = not self.start_after_token_ids
        self.matcher = None
        # The matcher took a stop token, as of its last ``accept_token``: read from the matcher
        # once per token taken, not on each of the several checks a step makes per request.
        self.terminated = False
        self.num_seen = 0  # output tokens taken into account (before the grammar started, too)
        # Where the newest sampled token can be read before it is committed: (PendingSample, row).
        self.last_sample: tuple[object, int] | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # Request.error_code for ``error``

    def dead_end(self) -> None:
        """No token of the vocabulary continues the grammar from here (a regex over characters
        the tokenizer cannot produce, past its start): the request's grammar cannot be
        completed, which is its input's fault."""
        self.error = (f"structured outputs: no token of this model's vocabulary continues the {self.grammar.kind} "
                      f"grammar after {self.num_seen} output tokens; the output cannot be completed")
        self.error_code = "invalid_grammar"

    def _start_matcher(self) -> None:
        self.matcher = self._new_matcher()
        self.terminated = False

    def _new_matcher(self):
        from deepbatch.structured_output.grammar import import_xgrammar

        return import_xgrammar().GrammarMatcher(self.grammar.grammar)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete and the request ends."""
        return self.matcher is not None and self.terminated

    @property
    def constrains_next_token(self) -> bool:
        return self.matcher is not None and self.error is None and not self.terminated

    def advance(self, output_token_ids: list[int], num_pending: int = 0) -> str | None:
        """Feed the matcher the output tokens it has not seen, ``output_token_ids`` and then
        ``num_pending`` (0 or 1) still on the device; returns why the request must fail (a token
        the grammar rejects, a matcher fault), else None. A pending token whose step has not
        produced it usably (that row failed) is left for the commit, which fails the request."""
        try:
            num_known = len(output_token_ids)
            if num_known + num_pending < self.num_seen:
                self._restart()
            if self.started and self.matcher is None:
                self._start_matcher()
            while self.error is None and self.num_seen < num_known + num_pending:
                if self.is_terminated:
                    break  # the request ends here; a token computed a step late is dropped
                if self.num_seen < num_known:
                    token = output_token_ids[self.num_seen]
                else:
                    token = self._read_pending()
                    if token is None:
                        break
                self._take(output_token_ids, token)
                self.num_seen += 1
        except Exception as e:  # noqa: BLE001 - this request's grammar fault ends this request alone
            self.error = f"structured outputs failed: {type(e).__name__}: {e}"[:500]
        return self.error

    def _take(self, output_token_ids: list[int], token: int) -> None:
        if not self.started:
            k = len(self.start_after_token_ids)
            window = output_token_ids[max(0, self.num_seen - k + 1) : self.num_seen] + [token]
            if tuple(window) == self.start_after_token_ids:
                self.started = True
                self._start_matcher()
            return
        if not self.matcher.accept_token(token):
            self.error = f"structured outputs: token {token} does not continue the {self.grammar.kind} grammar"
        self.terminated = self.matcher.is_terminated()

    def _read_pending(self) -> int | None:
        if self.last_sample is None:
            return None
        pending, row = self.last_sample
        out = pending.resolve()
        if out.errors and row in out.errors:
            return None
        return out.token_ids[row]

    def _restart(self) -> None:
        # The loop in ``advance`` then replays the tokens the request kept.
        self.started = not self.start_after_token_ids
        self.matcher = None
        self.terminated = False
        self.num_seen = 0
        self.error = None
        self.error_code = None

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def release(self) -> None:
        self.matcher = None
        self.last_sample = None
