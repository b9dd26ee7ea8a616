"""A step's sampled ids on their way to the host (``PendingSample``) and what they resolve to
(``SamplerOutput``): the one host sync of a step waits here, for these copies alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepbatch.core.logprobs import StepLogprobs
from deepbatch.kernels.logprobs_topk import logprobs_topk, logprobs_topk_ref
from deepbatch.sampling.host_copy import copy_to_host
from deepbatch.sampling.draft_rows import draft_row_owners, kept_rows

if TYPE_CHECKING:
    from deepbatch.sampling.prompt_logprobs import PendingPromptLogprobs


@dataclass
class SamplerOutput:
    """One step's results on the host; row ``i`` is the ``i``-th scheduled request that samples.

    ``prompt_logprobs`` (None unless a request of the step asked for them and its chunk ran
    prompt positions) maps a request id to ``(start, entries)``: ``entries[j]`` belongs to
    prompt position ``start + j`` and is ``(logprob, rank, top)`` of the prompt token at
    ``start + j + 1`` given those before it (``rank``: 1 + the number of more likely tokens;
    ``top``: ``{token_id: logprob}`` of the ``prompt_logprobs`` most likely, best first). A chunk
    covers exactly its positions whose next token is a prompt token, so the chunks of a chunked
    prefill follow one another; the prompt's last position (whose next token is sampled) has no
    entry. A prompt run again after preemption by recompute reports its positions again, from
    ``start`` 0 (``Request.record_prompt_logprobs`` keeps the first).
    """

    # A list where the request drafted (speculative decoding): the tokens it keeps, in order.
    token_ids: list[int | list[int]]
    # Row i: {token_id: Logprob}, the sampled token first (with its rank), then the top-k (ranks
    # 1..k), built when read; None for a row that did not ask. None when no row asked.
    logprobs: StepLogprobs | None = None
    # Row -> why that row's request failed (its token is meaningless); None when none did.
    errors: dict[int, str] | None = None
    prompt_logprobs: dict[str, tuple[int, list[tuple[float, int, dict[int, float]]]]] | None = None
    # A drafting request's row -> the ``logprobs`` rows of the tokens it keeps (one per token).
    token_rows: dict[int, list[int]] | None = None


class PendingSample:
    """A step's sampled ids (and logprobs) on their way to the host.

    ``token_ids`` stays on the device: the runner scatters it into its token pool, where the next
    step reads its inputs without a host sync. The host copies are queued (into pinned memory on a
    GPU) behind the sampling kernels; ``resolve`` waits for that copy alone, not for work queued after it.
    """

    def __init__(self, token_ids: torch.Tensor, logits: torch.Tensor | None, params,
                 errors: dict[int, str] | None = None, nan_rows: torch.Tensor | None = None, fused: bool = False):
        """``logits``: the processed logits of the step, given when a request asked for logprobs;
        ``fused``: their logprobs from the Triton kernel rather than its torch reference."""
        self.token_ids = token_ids
        self._params = params
        self._errors = errors
        pin = token_ids.device.type == "cuda"
        self._nan_rows = copy_to_host(nan_rows, pin) if nan_rows is not None else None
        self._host = copy_to_host(token_ids, pin)
        self._k_max = 0
        self._table = None
        if logits is not None:
            # One [S, 2 + 2k] table (kernels/logprobs_topk.py) and one copy: no [S, V] log-softmax.
            self._k_max = max((p.logprobs or 0) for p in params)
            table = (logprobs_topk if fused else logprobs_topk_ref)(logits, token_ids, self._k_max)
            self._table = copy_to_host(table, pin)
        self._prompt: PendingPromptLogprobs | None = None
        # Speculative decoding: the number of request rows and (row, drafts) per drafting request.
        self._drafts: tuple[int, list[tuple[int, list[int]]]] | None = None
        self._event = None
        self._record()
        self._resolved: SamplerOutput | None = None

    @classmethod
    def empty(cls, device: torch.device) -> PendingSample:
        """A step in which no request samples (its chunks still carry prompt logprobs)."""
        return cls(torch.empty(0, dtype=torch.long, device=device), None, [])

    def attach_prompt_logprobs(self, prompt: PendingPromptLogprobs) -> None:
        """Queued after the sampling: ``resolve`` then waits for their copies too."""
        self._prompt = prompt
        self._record()

    def attach_drafts(self, num_requests: int, drafts: list[tuple[int, list[int]]]) -> None:
        """Speculative decoding: rows past ``num_requests`` are the draft positions of ``drafts``
        (``sampling/draft_rows.py``); a drafting request's ``token_ids`` entry then resolves to
        the tokens it keeps."""
        self._drafts = (num_requests, drafts)

    def _record(self) -> None:
        if self.token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def resolve(self) -> SamplerOutput:
        if self._resolved is None:
            if self._event is not None:
                self._event.synchronize()  # the one host sync of a step
            token_ids = self._host.tolist()
            logprobs = None
            if self._table is not None:
                logprobs = _step_logprobs(self._table, self._k_max, token_ids, self._params)
            errors = dict(self._errors or {})
            if self._nan_rows is not None:
                for i in self._nan_rows.nonzero().flatten().tolist():
                    errors.setdefault(i, "the model produced NaN logits for this request")
            token_rows = None
            if self._drafts is not None:
                n, drafts = self._drafts
                token_rows = kept_rows(token_ids, n, drafts)
                if any(i >= n for i in errors):
                    owners = draft_row_owners(n, drafts)
                    for i in [i for i in errors if i >= n]:
                        errors.setdefault(owners[i], errors.pop(i))
                tokens = token_ids
                token_ids = tokens[:n]
                for row, rows in token_rows.items():
                    token_ids[row] = [tokens[i] for i in rows]
            prompt = self._prompt.resolve() if self._prompt is not None else None
            self._resolved = SamplerOutput(token_ids, logprobs, errors or None, prompt, token_rows)
        return self._resolved


def _step_logprobs(table: torch.Tensor, k: int, token_ids: list[int], params) -> StepLogprobs:
    """The kernel's host table as a ``StepLogprobs``, converted nowhere: each row's dict is built
    where it is read (``core/logprobs.py``). A copy, so the pinned buffer goes back to torch's
    host allocator at once (a pinned block held per step would make each step allocate anew)."""
    return StepLogprobs(table.numpy().copy(), k, token_ids, [p.logprobs for p in params])
