"""The per-step token bitmask: filled on the host, applied to the logits on the device.

The sampler calls ``apply_grammar_bitmask`` after the step's forward is queued, so the host fill
overlaps the forward; the bitmask then travels to the device (pinned, non-blocking) and masks
the logits before anything else can pick a token (bias, penalties, logprobs, sampling). Bit ``j``
of word ``w`` in a row allows token ``32 * w + j`` (xgrammar's layout).

A constrained row still under ``min_tokens`` has its EOS / stop ids cleared in its bitmask
(instead of the sampler's own ban), unless the grammar allows nothing else there: the grammar
wins, since a token it forbids would break the output.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deepbatch.core.draft_row import DraftRow
from deepbatch.core.request import Request

logger = logging.getLogger(__name__)


_batch_matcher = None


def _fill_rows(bitmask: torch.Tensor, requests: list[Request], rows: list[int]) -> dict[int, str]:
    """Fill the rows' bitmasks in one call of xgrammar's batched matcher (its threads share the
    rows, so a batch of grammars costs about what one does); when that call raises, row by row, so
    that the fault is pinned on its request. Returns row -> error for the rows that failed."""
    global _batch_matcher
    if len(rows) > 1:
        try:
            if _batch_matcher is None:
                from deepbatch.structured_output.grammar import import_xgrammar

                _batch_matcher = import_xgrammar().BatchGrammarMatcher()
            _batch_matcher.batch_fill_next_token_bitmask([requests[i].structured_output.matcher for i in rows],
                                                         bitmask, rows)
            return {}
        except Exception as e:  # noqa: BLE001 - find the row at fault below
            logger.warning("batched bitmask fill of %d rows failed (%s: %s); filling row by row",
                           len(rows), type(e).__name__, e)
    errors = {}
    for i in rows:
        try:
            requests[i].structured_output.fill_bitmask(bitmask, i)
        except Exception as e:  # noqa: BLE001 - one request's grammar fault ends that request alone
            errors[i] = f"structured outputs failed: {type(e).__name__}: {e}"[:500]
    return errors


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[Request]) -> set[int]:
    """Mask ``logits`` (``[len(requests), V]``, in place) where a request's grammar forbids a
    token; returns the rows masked. Brings each matcher up to the request's newest token first
    (reading a pending one from the step that sampled it). A row whose matcher fails is left
    unmasked with the error on its state: the engine ends that request at commit."""
    rows, drafting = [], {}
    for i, r in enumerate(requests):
        so = r.structured_output
        if so is None:
            continue
        if isinstance(r, DraftRow):  # filled below, walking the drafts
            drafting.setdefault(id(so), (r.request, r.drafts, {}))[2][r.offset] = i
            continue
        so.advance(r.output_token_ids, r.num_pending_tokens)
        if so.constrains_next_token:
            rows.append(i)
    if not rows and not drafting:
        return set()
    words = (logits.shape[1] + 31) // 32
    bitmask = torch.empty((len(requests), words), dtype=torch.int32, pin_memory=logits.is_cuda)
    bitmask.numpy().fill(-1)  # all allowed: the rows without a grammar stay so
    errors = _fill_rows(bitmask, requests, rows)
    draft_rows = _fill_draft_rows(bitmask, drafting.values())
    # One pass over every row (this runs each step for every constrained request), in numpy: a
    # host op that torch would hand to its thread pool. A row with no bit set allows nothing.
    allows_some = bitmask.numpy().any(axis=1).tolist()
    masked = set()
    for i in rows + draft_rows:
        r = requests[i]
        if i in errors:
            r.structured_output.error = errors[i]
            bitmask[i] = -1
            continue
        if not allows_some[i]:  # nothing to draw: fail it at commit, sample it unmasked meanwhile
            if not isinstance(r, DraftRow) or r.offset == 0:
                # Past a draft the dead end is the draft's: if the row is kept, the commit's
                # matcher refuses its token and fails the request.
                r.structured_output.dead_end()
            bitmask[i] = -1
            continue
        if r.num_output_tokens < r.sampling_params.min_tokens:  # a row view only where needed
            _ban_until_min_tokens(bitmask[i], r)
        masked.add(i)
    if masked:
        apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), sorted(masked))
    return masked


def _fill_draft_rows(bitmask: torch.Tensor, drafting) -> list[int]:
    """Speculative decoding: each drafting request's rows (``(request, drafts, {offset: row})``)
    filled in order, the matcher taking draft ``j`` after row ``j``'s fill, then taken back to the
    request's newest token (the commit feeds it the tokens kept). Rows past a draft the grammar
    refuses, or past its end, stay all allowed: the draw before them differs from its draft, so
    they are not kept. Returns the rows filled; a matcher fault is the request's error."""
    filled = []
    for r, drafts, at in drafting:
        so = r.structured_output
        so.advance(r.output_token_ids, r.num_pending_tokens)
        if not so.constrains_next_token:
            continue
        taken = 0
        try:
            for j in range(len(drafts) + 1):
                so.fill_bitmask(bitmask, at[j])
                filled.append(at[j])
                if j == len(drafts) or not so.matcher.accept_token(drafts[j]):
                    break
                taken += 1
                if so.matcher.is_terminated():
                    break
        except Exception as e:  # noqa: BLE001 - one request's grammar fault ends that request alone
            so.error = f"structured outputs failed: {type(e).__name__}: {e}"[:500]
        finally:
            if taken:
                so.matcher.rollback(taken)
    return filled


def _ban_until_min_tokens(row: torch.Tensor, r: Request) -> None:
    """Clear the request's EOS / stop ids in its row (it is still under ``min_tokens``), unless
    that leaves the grammar nothing."""
    p = r.sampling_params
    if r.num_output_tokens >= p.min_tokens:
        return
    banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p._eos_token_ids))
    banned = [t for t in banned if t < row.shape[0] * 32]
    if not banned:
        return
    kept = row.numpy().view(np.uint32).copy()  # the host row: unsigned, so bit 31 is plain
    for t in banned:
        kept[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    if kept.any():
        row.copy_(torch.from_numpy(kept.view(np.int32)))


def warm_up_bitmask(vocab_size: int, device: torch.device) -> None:
    """Compile xgrammar's mask kernel before the first request, where xgrammar is installed (a
    no-op otherwise, and nothing is imported). Triton compiles it once per class of its row count
    (1, a multiple of 16, any other): a batch of constrained rows would otherwise pay a compile
    the first time its count falls in a class, mid-traffic."""
    import importlib.util

    if importlib.util.find_spec("xgrammar") is None:
        return
    words = (vocab_size + 31) // 32
    for rows in (1, 16, 17):
        logits = torch.zeros(rows, vocab_size, device=device)
        bitmask = torch.full((rows, words), -1, dtype=torch.int32, device=device)
        apply_bitmask(logits, bitmask, list(range(rows)))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[i, t]`` to -inf for each row ``i`` in ``rows`` whose bitmask clears bit ``t``.
    xgrammar's kernel (C++ on the CPU, Triton on a GPU) where it takes the logits; the unpacked
    mask through torch otherwise."""
    if logits.dtype == torch.float32 and (logits.is_cuda or logits.device.type == "cpu"):
        from deepbatch.structured_output.grammar import import_xgrammar

        try:
            import_xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=rows)
            return
        except Exception as e:  # noqa: BLE001 - e.g. no Triton for this GPU: the torch path is exact too
            logger.debug("xgrammar's bitmask kernel is unavailable (%s); masking through torch", e)
    apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    index = torch.tensor(rows, device=logits.device)
    allowed = unpack_bitmask(bitmask.index_select(0, index), logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, vocab_size]`` bool (True: allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def remember_samples(pending, requests: list[Request]) -> None:
    """Tell each structured request which step row holds its newest (maybe pending) token."""
    for i, r in enumerate(requests):
        if r.structured_output is not None and not isinstance(r, DraftRow):
            r.structured_output.last_sample = (pending, i)
