"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, in its own prompt and output (the latest with k tokens after it, where
one has).

    tokens:   ... a b c d e ... x a b c | ?        last n = 3 tokens: "a b c"
                    ^^^^^ d e f            the latest earlier "a b c" is followed by "d e f"
    drafts:   d e f (up to k)

The largest n in [min_n, max_n] that occurs wins: a longer match is more likely to go on the same
way. Code edits, answers quoted from a document and summaries copy their prompt, so their drafts
are often right; the target model verifies every draft (``sampling/draft_rows.py``), so a wrong
one costs only the slot it ran in.
"""

from __future__ import annotations

import numpy as np

from deepbatch.spec_decode.room import draft_room, speculation_off


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafts for the sequence ``tokens`` (1-D integers); [] when none of its last
    ``min_n..max_n`` tokens occur earlier with a token after them."""
    length = len(tokens)
    if k <= 0 or length < 2:
        return []
    # Where an earlier copy of the suffix could end: the positions holding the last token (one
    # pass over the sequence); each n then checks only those, one token further back at a time.
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            hits = hits[tokens[hits - back] == tokens[length - 1 - back]]
        if len(hits):
            # The latest occurrence with k tokens after it, else the latest: in a repeating
            # stretch the latest overlaps the end and would draft one token.
            full = hits[hits + 1 + k <= length]
            start = int(full[-1] if len(full) else hits[-1]) + 1
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

    Every decoding request drafts: each draft row is drawn as the request would draw at that
    position (``sampling/draft_rows.py``), its penalties and grammar included."""

    def __init__(self, config, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        # Each drafting request's tokens as an array, extended by what it sampled since (a list
        # converted whole every step would cost as much as the search).
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, running: list, spec_cost=None) -> None:
        """Set ``spec_token_ids`` of every running request (empty where it does not draft),
        each capped by ``spec_cost`` (``control/spec_cost.py``) when given."""
        cfg = self.config
        off = speculation_off(cfg, running)
        for r in running:
            k = 0 if off else draft_room(r, cfg.num_speculative_tokens, self.max_model_len)
            r.spec_token_ids = propose_ngram(self._array(r), cfg.prompt_lookup_min,
                                             cfg.prompt_lookup_max, k) if k else []
        if spec_cost is not None:
            spec_cost.limit(running)
        if len(self._tokens) > 2 * len(running) + 64:  # preempted requests' arrays
            ids = {r.request_id for r in running}
            self._tokens = {i: v for i, v in self._tokens.items() if i in ids}

    def forget(self, request_id: str) -> None:
        """The request ended: drop its token array."""
        self._tokens.pop(request_id, None)

    def _array(self, r) -> np.ndarray:
        buf, n = self._tokens.get(r.request_id, (None, 0))
        tokens = r.all_token_ids
        if buf is None or len(tokens) < n:  # new, or preempted and rebuilt
            buf, n = np.empty(max(2 * len(tokens), 64), dtype=np.int64), 0
        if len(tokens) > len(buf):
            buf = np.concatenate([buf[:n], np.empty(len(tokens), dtype=np.int64)])
        buf[n:len(tokens)] = tokens[n:]
        self._tokens[r.request_id] = (buf, len(tokens))
        return buf[:len(tokens)]
