"""What crosses from the engine core to an API process per request and step (``OutputDelta``):
only what is new since the last message, read from the requests' own samples."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.request import Request
from deepbatch.engine.core_messages import CompletionDelta, OutputDelta
from deepbatch.engine.output_processor import parent_state


class OutputDeltas:
    """``deltas(parent_id, children)``: the parent request's progress since the previous call."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentSoFar] = {}  # parent id -> how much of its output was sent

    def __call__(self, parent_id: str, children: list[Request]) -> OutputDelta:
        """What is new of a parent request since the last message: read from its samples
        directly, so a step costs the new tokens, not a copy of every output so far."""
        sent = self._sent.get(parent_id)
        if sent is None:  # not setdefault: no throwaway object per request per step
            sent = self._sent[parent_id] = _SentSoFar()
        completions = []
        for r in children:
            ids, logprobs = r.output_token_ids, r.logprobs
            num_tokens, num_logprobs = sent.completions.get(r.index, (0, 0))
            completions.append(CompletionDelta(
                r.index, num_tokens, ids[num_tokens:], r.finish_reason, r.stop_reason, num_logprobs,
                None if logprobs is None else logprobs.wire(num_logprobs)))
            sent.completions[r.index] = (len(ids), len(logprobs) if logprobs is not None else 0)
        first = children[0]
        prompt_offset = sent.num_prompt_logprobs
        prompt_logprobs = None
        if first.prompt_logprobs is not None and len(first.prompt_logprobs) > prompt_offset:
            prompt_logprobs = [None if entry is None else {t: (lp.logprob, lp.rank) for t, lp in entry.items()}
                               for entry in first.prompt_logprobs[prompt_offset:]]
            sent.num_prompt_logprobs = len(first.prompt_logprobs)
        if len(children) == 1:  # the common case, without parent_state's generality
            finished, error = first.is_finished, first.error
        else:
            finished, error = all(r.is_finished for r in children), next((r.error for r in children if r.error), None)
        # The metrics change at the first token and at the end: sent then, carried over between.
        metrics = None
        if finished or error is not None or not sent.started:
            _, num_cached, error, error_code, m = parent_state(children)
            sent.started = first.first_token_time is not None
            metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time, m.num_preemptions)
        else:
            num_cached, error_code = max(first.num_cached_tokens, 0), None
        if finished:
            del self._sent[parent_id]
        return OutputDelta(parent_id, completions, finished, num_cached, error, error_code, metrics, prompt_offset,
                           prompt_logprobs)


@dataclass
class _SentSoFar:
    # sample index -> (token ids, logprobs) already sent
    completions: dict[int, tuple[int, int]] = field(default_factory=dict)
    num_prompt_logprobs: int = 0
    started: bool = False  # metrics with a first token time were sent


def refusal(request_id: str, error: BaseException) -> OutputDelta:
    if isinstance(error, InvalidRequestError):
        refusal = ("invalid", error.param, str(error), error.code)
    else:
        refusal = ("error", None, f"{type(error).__name__}: {error}"[:1000], "internal_error")
    return OutputDelta(request_id, [], True, 0, None, None, None, refusal=refusal)
