"""Drafts from DeepSeek-V3/R1's multi-token-prediction layer (``SpeculativeConfig``, method mtp).

The layer at position p reads the target's hidden state there and the token after it, and
predicts the token after that (``runner/mtp_runner.py``). Before a drafting step, for a request
of n tokens (the newest, t[n-1], not yet run by the target):

    forward 1:  positions the MTP cache lacks, up to n-2, with t[p+1]      -> d1 (from p = n-2)
    forward j:  position n-3+j, with d(j-1) and the layer's own last output -> dj   (j = 2..k)

Position n-2 always runs again: its output is where the first draft comes from. The positions
of the chained forwards held drafts, not the request's tokens, so the cache keeps only the
positions the target had run; the next step starts past them. Blocks, the catch-up budget and
the cost model's caps are the draft model's (``spec_decode/draft_model.py``).
"""

from __future__ import annotations

import numpy as np

from deepbatch.spec_decode.draft_model import DraftModelProposer, DraftSeq, places


class MTPProposer(DraftModelProposer):
    """``runner`` is the ``MTPRunner``: ``forward``, ``block_size``."""

    def _span(self, seq: DraftSeq, tokens: list[int]) -> tuple[int, int]:
        # The target has run every position before the newest token; the last of them gives d1.
        return min(seq.computed, len(tokens) - 2), len(tokens) - 1

    def _draft(self, jobs: list) -> None:
        bs = self.runner.block_size
        slots = []
        for r, _, start, end, _ in jobs:
            pos = np.arange(start, end)
            slots.append(np.asarray(r.block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs)
        tokens = self.runner.forward([(r.all_token_ids[start + 1:end + 1], start, seq.blocks, k > 0)
                                      for r, seq, start, end, k in jobs],
                                     slots=np.concatenate(slots), rows=places([r for r, *_, k in jobs if k], 0))
        drafting = []
        for r, seq, _, end, k in jobs:
            seq.computed = end
            if k:
                r.spec_token_ids = [tokens[len(drafting)]]
                drafting.append((r, seq, k, len(drafting)))
        for j in range(1, max((k for _, _, k, _ in drafting), default=0)):
            drafting = [d for d in drafting if d[2] > j]
            tokens = self.runner.forward([(r.spec_token_ids[-1:], seq.computed + j - 1, seq.blocks, True)
                                          for r, seq, _, _ in drafting], chain=[row for *_, row in drafting],
                                         rows=places([r for r, _, _, _ in drafting], j))
            for (r, _, _, _), t in zip(drafting, tokens):
                r.spec_token_ids.append(t)
            drafting = [(r, seq, k, i) for i, (r, seq, k, _) in enumerate(drafting)]
