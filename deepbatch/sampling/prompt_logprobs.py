"""Prompt logprobs: for the prompt positions a step's chunks run, the logprob of the prompt token
that follows each one, its rank and the top alternatives, from the model's raw logits (no logit
bias, penalties or temperature: those shape sampling, not the model's distribution), in float32.

One request's chunk in the step's flat rows, prompt of ``P`` tokens::

    positions:        start  start+1  ...  P-2 | P-1          ... end-1
    next token:       p[start+1]      ...  P-1 | sampled, or an output token (after a recompute)
                      |<- PromptLogprobRows ->|   no prompt logprob

Rows are turned into logits a slice at a time (``_MAX_LOGIT_ELEMENTS``), so a long chunk never
holds ``[rows, vocab]`` floats at once. Every tensor-parallel rank makes the same
``compute_logits`` calls in the same order (each is a collective); only rank 0 gets logits back
and computes the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepbatch.core.request import Request
from deepbatch.sampling.host_copy import to_host

# Logits (and their log-softmax) held at once for prompt rows: 64 MiB of float32 each.
_MAX_LOGIT_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """A run of one request's chunk whose next tokens are prompt tokens."""

    request: Request  # on a tensor-parallel worker, its mirror (only rank 0 reads the params)
    start: int  # the first position
    row: int  # that position's row in the step's flat hidden states
    count: int


def prompt_logprob_rows(request: Request, start: int, end: int, row: int) -> PromptLogprobRows | None:
    """The rows of a chunk over positions ``[start, end)`` starting at flat row ``row`` that
    have a prompt token next, if the request asks for prompt logprobs and there are any."""
    # A tensor-parallel worker's mirror carries it too (the step message does).
    stop = min(end, request.prompt_logprobs_end)
    return PromptLogprobRows(request, start, row, stop - start) if stop > start else None


class PendingPromptLogprobs:
    """A step's prompt logprobs on their way to the host: the copies are queued (into pinned
    memory on a GPU) behind the kernels; ``resolve`` reads them once the step's event has
    completed (``PendingSample`` waits for it)."""

    def __init__(self, segments: list[PromptLogprobRows], chosen: torch.Tensor, ranks: torch.Tensor,
                 top_vals: torch.Tensor | None, top_ids: torch.Tensor | None):
        self._segments = segments
        self._host = [to_host(chosen), to_host(ranks)]
        if top_vals is not None:
            self._host += [to_host(top_vals), to_host(top_ids)]

    def resolve(self) -> dict[str, tuple[int, list[tuple[float, int, dict[int, float]]]]]:
        chosen, ranks = self._host[0].tolist(), self._host[1].tolist()
        top_vals = self._host[2].tolist() if len(self._host) > 2 else None
        top_ids = self._host[3].tolist() if len(self._host) > 2 else None
        out = {}
        i = 0
        for seg in self._segments:
            k = seg.request.sampling_params.prompt_logprobs
            entries = []
            for j in range(i, i + seg.count):
                top = {top_ids[j][c]: top_vals[j][c] for c in range(k)} if k else {}
                entries.append((chosen[j], ranks[j], top))
            out[seg.request.request_id] = (seg.start, entries)
            i += seg.count
        return out


@torch.no_grad()
def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
                            segments: list[PromptLogprobRows], vocab_size: int) -> PendingPromptLogprobs | None:
    """Queue the prompt logprobs of ``segments`` (rows of ``hidden``); None on tensor-parallel
    ranks other than 0. ``compute_logits`` is the model's; ``vocab_size`` sets the slice size
    and must be the same on every rank, so that the ranks' collectives pair up."""
    dev = hidden.device
    rows = _to_device(torch.cat([torch.arange(s.row, s.row + s.count) for s in segments]), dev)
    per_slice = max(1, _MAX_LOGIT_ELEMENTS // max(vocab_size, 1))
    targets = None
    k_max = 0
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, rows.shape[0], per_slice):
        logits = compute_logits(hidden[rows[lo:lo + per_slice]])
        if logits is None:  # a tensor-parallel worker: keep making the same calls as rank 0
            continue
        if targets is None:
            ids = [t for s in segments for t in s.request.prompt_token_ids[s.start + 1:s.start + 1 + s.count]]
            targets = _to_device(torch.tensor(ids, dtype=torch.long), dev)
            k_max = max(s.request.sampling_params.prompt_logprobs for s in segments)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = targets[lo:lo + logits.shape[0]].unsqueeze(1)
        picked = logprobs.gather(1, target)
        chosen.append(picked.squeeze(1))
        # vLLM's rank: 1 + the number of tokens strictly more likely.
        ranks.append((logprobs > picked).sum(dim=-1) + 1)
        if k_max:
            vals, ids = logprobs.topk(k_max, dim=-1)
            top_vals.append(vals)
            top_ids.append(ids)
    if targets is None:
        return None
    return PendingPromptLogprobs(segments, torch.cat(chosen), torch.cat(ranks),
                                 torch.cat(top_vals) if k_max else None, torch.cat(top_ids) if k_max else None)


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    # Pinned, the copy queues behind the step's kernels instead of waiting for them.
    return (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
