"""Verifying drafted tokens against the target model (speculative decoding), on the device.

A request that drafted ``d_0 .. d_{m-1}`` runs its newest token and the drafts in one step; the
logits at the draft positions give the target's distribution ``p_j`` of the token in draft ``j``'s
place (row ``j``). Draft ``j`` is accepted with probability ``p_j(d_j)``; the first one rejected is
replaced by a token drawn from ``p_j`` without ``d_j`` (renormalized), and the rest are dropped.
When every draft is accepted, the token after them comes from the ordinary sampler on the row
after the last draft (the bonus token). This is the rejection sampling of Leviathan et al. (2023)
for a draft distribution that puts all its mass on ``d_j`` (prompt lookup proposes tokens, not
distributions), so every output token is distributed exactly as without speculation:
``p(d) * [d] + (1 - p(d)) * p_without_d = p``. A greedy row accepts a draft equal to the argmax,
and replaces the first that is not by the argmax.

``p_j`` is the sampler's distribution for the request: its logit bias, temperature, top-k, top-p
and min-p (``Sampler.filtered_probs``). Requests whose distribution moves with each token they add
(penalties, seeds, min_tokens, grammars) or that report logprobs do not draft
(``spec_decode/ngram.py``), so one distribution per row holds.
"""

from __future__ import annotations

import torch


def verify_drafts(probs: torch.Tensor, logits: torch.Tensor, draft_ids: torch.Tensor,
                  greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs``/``logits``: ``[D, V]`` at the draft rows (probs of the sampled rows, logits for the
    greedy ones); ``draft_ids``, ``greedy``: ``[D]``. Returns ``accepted [D]`` (bool) and
    ``recovered [D]``: the token that replaces a rejected draft (meaningful where rejected)."""
    rows = torch.arange(len(draft_ids), device=draft_ids.device)
    argmax = logits.argmax(dim=-1)
    p_draft = probs[rows, draft_ids]
    accepted = torch.where(greedy, argmax == draft_ids, torch.rand_like(p_draft) < p_draft)
    residual = probs.clone()
    residual[rows, draft_ids] = 0.0
    # argmax(r / q), q ~ Exp(1), draws from r normalized: no sum, no sync.
    recovered = (residual / torch.empty_like(residual).exponential_()).argmax(dim=-1)
    return accepted, torch.where(greedy, argmax, recovered)


def step_drafts(scheduled) -> tuple[list[int], list[list[int]], list, list[int]]:
    """A step's drafts (``ScheduledRequest``s in order): the sampled rows that drafted, their
    drafts, and per draft row its request and its draft, in the order the runner lays them out."""
    rows, drafts, row_requests, draft_ids = [], [], [], []
    for row, s in enumerate(s for s in scheduled if s.samples):
        if s.num_spec_tokens:
            d = s.request.spec_token_ids[:s.num_spec_tokens]
            rows.append(row), drafts.append(d)
            row_requests += [s.request] * len(d)
            draft_ids += d
    return rows, drafts, row_requests, draft_ids


def accepted_prefix(accepted: list[bool], recovered: list[int], drafts: list[int], offset: int,
                    bonus: int) -> list[int]:
    """One request's tokens from the host copies: its accepted drafts (rows ``offset`` on), then
    the replacement of the first rejected one, or the bonus token when none was."""
    n = 0
    while n < len(drafts) and accepted[offset + n]:
        n += 1
    return drafts[:n] + [bonus if n == len(drafts) else recovered[offset + n]]
