"""Verifying drafted tokens against the target model (speculative decoding) by drawing every
position as usual.

A request that drafted ``d_0 .. d_{m-1}`` runs its newest token and the drafts in one step. The
logits at the newest token and at ``d_0 .. d_{m-2}`` give the target's distribution of the token
in draft ``j``'s place (the draft rows, laid after the requests' own rows); the logits at
``d_{m-1}`` give the token after the last draft (the request's own row). The sampler draws a token
from every row, exactly as it would for the request at that output position (``DraftRow``: the
request seen ``j`` tokens later, so min_tokens and a seed's noise, keyed by the output position,
are those of that position). The request keeps the draws up to and including the first one that
differs from its draft, or all of them and the draw of its own row when every draft matched.

Each kept token is the target's draw given the tokens kept before it, so the output is distributed
exactly as without speculation (a draft matches with the probability the target gives it; the
first draw that differs is the token in its place), and a seeded request writes the same tokens
with and without drafts. Logprobs are those of the rows the kept tokens came from. Requests whose
distribution at a position depends on the tokens before it in a way one row cannot see
(penalties, whose counts move with each token, and grammars) do not draft
(``spec_decode/ngram.py``).
"""

from __future__ import annotations

import torch

from deepbatch.core.draft_row import DraftRow
from deepbatch.core.request import Request


def step_drafts(scheduled) -> list[tuple[int, list[int]]]:
    """A step's drafts (``ScheduledRequest``s in order): ``(row, drafts)`` per drafting request,
    ``row`` its place among the requests that sample, in the order the runner lays them out."""
    out = []
    for row, s in enumerate(s for s in scheduled if s.samples):
        if s.num_spec_tokens:
            out.append((row, s.request.spec_token_ids[:s.num_spec_tokens]))
    return out


def sampling_rows(requests: list[Request], drafts: list[tuple[int, list[int]]]) -> list:
    """What the sampler draws for, row by row: the requests (a drafting one seen past its drafts,
    where its row is), then each drafting request's rows in its drafts' places."""
    rows = list(requests)
    for row, d in drafts:
        r = requests[row]
        rows[row] = DraftRow(r, len(d), d)
        rows += [DraftRow(r, j, d) for j in range(len(d))]
    return rows


def draft_row_owners(num_requests: int, drafts: list[tuple[int, list[int]]]) -> dict[int, int]:
    """Each draft row -> the row of the request it belongs to (a draft row's fault is its
    request's)."""
    owners, at = {}, num_requests
    for row, d in drafts:
        owners.update(dict.fromkeys(range(at, at + len(d)), row))
        at += len(d)
    return owners


def kept_rows(token_ids: list[int], num_requests: int, drafts: list[tuple[int, list[int]]]) -> dict[int, list[int]]:
    """Per drafting request's row, the rows whose draws it keeps, in order (``token_ids``: every
    row's draw, on the host)."""
    kept, offset = {}, num_requests
    for row, d in drafts:
        n = 0
        while n < len(d) and token_ids[offset + n] == d[n]:
            n += 1
        kept[row] = list(range(offset, offset + n + 1)) if n < len(d) else [*range(offset, offset + n), row]
        offset += len(d)
    return kept


def draws_like_target(params, structured_output) -> bool:
    """Whether a drafting model draws this request's drafts as its target will (``draw_drafts``):
    a sampled request without penalties or a grammar, whose draw at a place needs nothing but
    the logits (the others' drafts are the argmax)."""
    return not params.greedy and not params.needs_penalties and structured_output is None


def draw_drafts(sampler, logits: torch.Tensor, rows: list[DraftRow] | None) -> list[int]:
    """A drafting model's tokens (``logits``: one row per draft), each drawn as the target will
    draw the token in its place: ``rows[i]`` is that place (the request seen past the drafts
    before it), so the draw takes the request's temperature, filters and noise at that output
    position. The target's draw there is then the draft wherever the two models' distributions
    agree enough to pick the same token under the same noise (coupled draws): a draft model as
    good as its target drafts every sampled token right, where a greedy draft is right only as
    often as the target draws the likeliest token. The noise is the request's seed's; the engine
    gives each request drawn this way that has none a seed of its own
    (``LLMEngine.make_requests``), since unseeded noise is drawn afresh by every call. Rows that
    ``draws_like_target`` rules out (and every row when ``rows`` is None) take the argmax."""
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, r in enumerate(rows or ()) if draws_like_target(r.sampling_params, r.structured_output)]
    if drawn:
        idx = torch.tensor(drawn, device=logits.device)
        # A row whose draw fails comes back as token 0: only that draft is wrong.
        tokens[idx] = sampler.sample(logits[idx].float(), [rows[i] for i in drawn]).token_ids.to(tokens.dtype)
    return tokens.tolist()
