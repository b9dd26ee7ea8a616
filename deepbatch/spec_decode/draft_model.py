"""Drafts from a small model (``SpeculativeConfig``, method draft_model).

Before a step, for the requests that draft, the draft model (``runner/draft_model_runner.py``)
runs k forwards over the batch:

    forward 1:  each request's tokens the draft cache lacks   -> d1
    forward j:  d(j-1), one token per request                 -> dj        (j = 2..k)

Each draft is drawn as the target will draw the token in its place (``places``: the argmax for a
greedy request; for a sampled one its temperature, filters and noise at that output position), so
a draft model close to its target drafts the target's own draws.

The draft cache keeps what it computed: the request's tokens, then d1..d(k-1). After the step the
request's newest tokens are its accepted drafts and one more, so the cached prefix runs up to the
first draft that was not kept, and forward 1 of the next step computes only what follows it:
usually the one token the target drew in place of a rejected draft, or the last accepted draft
and the bonus token. A request that just started decoding catches up over its whole prompt, at
most ``max_catch_up`` tokens per step over the batch (the rest on later steps, drafting nothing
meanwhile), so a burst of long prompts cannot make the draft's activations outgrow the target's.

The draft cache's blocks come from a pool of its own; a request gives them back when it leaves
the running set (at its end, or before the next step when preempted: a preempted request
catches up again when it runs). A request that finds no free block drafts nothing that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepbatch.core.draft_row import DraftRow
from deepbatch.spec_decode.room import draft_room, speculation_off


def places(requests: list, offset: int) -> list[DraftRow] | None:
    """Where each request's draft number ``offset`` (0-based) will stand when the target draws it:
    the request seen past the drafts before it. None when every request is greedy (the drafter
    then takes the argmax without them: no rows to build)."""
    if all(r.sampling_params.greedy for r in requests):
        return None
    return [DraftRow(r, offset, r.spec_token_ids[:offset]) for r in requests]


@dataclass
class DraftSeq:
    """One request's state in the draft cache."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # the request's first tokens whose KV the draft cache holds
    drafts: list[int] = field(default_factory=list)  # the drafts whose KV follows them

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (the request's, append-only) the cache holds: its computed
        tokens and the drafts that the request went on to keep."""
        n = min(self.computed, len(tokens))
        for d in self.drafts:
            if n >= len(tokens) or tokens[n] != d:
                break
            n += 1
        return n


class DraftModelProposer:
    """Sets ``spec_token_ids`` of the running requests from the draft model's tokens.
    ``runner`` is the draft's ``DraftModelRunner``: ``forward``, ``block_size``, ``num_blocks``."""

    def __init__(self, config, runner, max_model_len: int, max_catch_up: int):
        self.config = config
        self.runner = runner
        self.max_model_len = max_model_len
        self.max_catch_up = max_catch_up
        self.seqs: dict[str, DraftSeq] = {}
        self.free_blocks: list[int] = []

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))

    def propose(self, running: list, spec_cost=None) -> None:
        """Set ``spec_token_ids`` of every running request (empty where it does not draft).
        With ``spec_cost`` (``control/spec_cost.py``) each request's count is capped before the
        draft runs, so the forwards the cost model would cut are never run."""
        self._release_left(running)
        cfg = self.config
        off = speculation_off(cfg, running)
        for r in running:
            k = 0 if off else draft_room(r, cfg.num_speculative_tokens, self.max_model_len)
            # Placeholders the cost model caps: only the count matters to it.
            r.spec_token_ids = [0] * k
        if spec_cost is not None:
            spec_cost.limit(running)
        jobs, budget = [], self.max_catch_up
        for r in running:
            k = len(r.spec_token_ids)
            r.spec_token_ids = []
            if k == 0:
                continue
            seq = self.seqs.setdefault(r.request_id, DraftSeq())
            start, last = self._span(seq, r.all_token_ids)
            end = min(last, start + budget)
            if end < last:  # a long catch-up: part of it now, drafts on a later step
                k = 0
            if end <= start or not self._reserve(seq, end + max(k - 1, 0)):
                continue
            budget -= end - start
            seq.computed, seq.drafts = start, []  # what lies past ``start`` is rewritten now
            jobs.append((r, seq, start, end, k))
        if jobs:
            self._draft(jobs)

    def _span(self, seq: DraftSeq, tokens: list[int]) -> tuple[int, int]:
        """The positions ``[start, end)`` to run before drafting: past what the cache holds, up
        to the newest token, which always runs (its output is the first draft)."""
        return min(seq.valid_prefix(tokens), len(tokens) - 1), len(tokens)

    def _draft(self, jobs: list) -> None:
        tokens = self.runner.forward([(r.all_token_ids[start:end], start, seq.blocks, k > 0)
                                      for r, seq, start, end, k in jobs], places([r for r, *_, k in jobs if k], 0))
        drafting = []
        for r, seq, _, end, k in jobs:
            seq.computed = end
            if k:
                r.spec_token_ids = [tokens[len(drafting)]]
                drafting.append((r, seq, k))
        for j in range(1, max((k for _, _, k in drafting), default=0)):
            drafting = [(r, seq, k) for r, seq, k in drafting if k > j]
            # Draft j's KV at its position (the request's tokens, then drafts 1..j-1).
            tokens = self.runner.forward([(r.spec_token_ids[-1:], seq.computed + j - 1, seq.blocks, True)
                                          for r, seq, _ in drafting], places([r for r, _, _ in drafting], j))
            for (r, seq, _), t in zip(drafting, tokens):
                seq.drafts.append(r.spec_token_ids[-1])
                r.spec_token_ids.append(t)

    def _reserve(self, seq: DraftSeq, num_positions: int) -> bool:
        """Blocks for the first ``num_positions`` positions of ``seq``; False (and none taken)
        when the pool cannot give them."""
        need = -(-num_positions // self.runner.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(self.free_blocks):
            return False
        seq.blocks.extend(self.free_blocks[-need:])
        del self.free_blocks[-need:]
        return True

    def forget(self, request_id: str) -> None:
        """The request ended: its draft blocks go back to the pool."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.free_blocks.extend(seq.blocks)

    def _release_left(self, running: list) -> None:
        """Give back the blocks of requests no longer running."""
        ids = {r.request_id for r in running}
        for rid in [i for i in self.seqs if i not in ids]:
            self.free_blocks.extend(self.seqs.pop(rid).blocks)
