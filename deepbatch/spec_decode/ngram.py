"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, in its own prompt and output (the latest with k tokens after it, where
one has).

    tokens:   ... a b c d e ... x a b c | ?        last n = 3 tokens: "a b c"
                    ^^^^^ d e f            the latest earlier "a b c" is followed by "d e f"
    drafts:   d e f (up to k)

The largest n in [min_n, max_n] that occurs wins: a longer match is more likely to go on the same
way. Code edits, answers quoted from a document and summaries copy their prompt, so their drafts
are often right; the target model verifies every draft (``sampling/rejection.py``), so a wrong one
costs only the slot it ran in.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafts for the sequence ``tokens`` (1-D integers); [] when none of its last
    ``min_n..max_n`` tokens occur earlier with a token after them."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows that start before the suffix itself and have at least one token after them.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            # The latest occurrence with k tokens after it, else the latest: in a repeating
            # stretch the latest overlaps the end and would draft one token.
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


def propose_ngram_ref(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The same in plain Python, for the tests."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            i = (full or starts)[-1]
            return tokens[i + n:i + n + k]
    return []


class NgramProposer:
    """Drafts for the running requests before each step (``SpeculativeConfig``, method ngram).

    A request drafts only where one distribution per position holds for its next tokens (the
    verification's premise, ``sampling/rejection.py``): no penalties (their counts move with each
    token), no seed (its noise is keyed by the output position), no grammar, no logprobs, past its
    min_tokens. The others decode one token per step beside the drafting ones."""

    def __init__(self, config, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, running: list) -> None:
        """Set ``spec_token_ids`` of every running request (empty where it does not draft)."""
        cfg = self.config
        off = cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size
        for r in running:
            k = 0 if off else self._room(r)
            r.spec_token_ids = propose_ngram(np.asarray(r.all_token_ids), cfg.prompt_lookup_min,
                                             cfg.prompt_lookup_max, k) if k else []

    def _room(self, r) -> int:
        """How many drafts the request may take this step (0: none)."""
        p = r.sampling_params
        if (r.num_pending_tokens or r.num_tokens - r.num_computed_tokens != 1 or p.needs_penalties
                or p.seed is not None or p.logprobs is not None or r.structured_output is not None
                or r.num_output_tokens < p.min_tokens):
            return 0
        # The step adds the accepted drafts and one token more: neither limit may be passed.
        return max(0, min(self.config.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1,
                          self.max_model_len - r.num_tokens - 1))
