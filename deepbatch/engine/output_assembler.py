"""The API process's copy of each request's output, rebuilt from the engine core's deltas
(``core_messages.OutputDelta``): what a stream, an observer and a final reply read."""

from __future__ import annotations

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepbatch.engine.core_messages import CompletionDelta, OutputDelta


class OutputAssembler:
    """Each request's cumulative ``RequestOutput``, rebuilt from the core's deltas."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}  # parent id -> its output so far

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], tenant: str) -> None:
        """A request sent to the core: what its deltas are applied to (they carry no prompt)."""
        self._outputs[request_id] = RequestOutput(request_id, prompt, prompt_token_ids, tenant=tenant)

    def drop(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)

    def clear(self) -> None:
        self._outputs.clear()

    def apply(self, delta: OutputDelta) -> RequestOutput:
        """The request's cumulative output with ``delta`` applied (a new object each time: a
        stream holds the newest output and a reader may still be looking at the previous one)."""
        previous = self._outputs.get(delta.request_id)
        if previous is None:  # not added here (cannot happen while the link is whole): no prompt to carry
            previous = RequestOutput(delta.request_id, None, [])
        before = previous.outputs
        if len(delta.completions) == 1 and len(before) <= 1:  # one sample: no index map needed
            completions = [_applied(before[0] if before else None, delta.completions[0])]
        else:
            by_index = {c.index: c for c in before}
            for c in delta.completions:
                by_index[c.index] = _applied(by_index.get(c.index), c)
            completions = [by_index[i] for i in sorted(by_index)]
        prompt_logprobs = previous.prompt_logprobs
        if delta.prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs or [])[:delta.prompt_logprobs_offset] + [
                None if entry is None else {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()}
                for entry in delta.prompt_logprobs]
        m = delta.metrics
        out = RequestOutput(
            request_id=delta.request_id, prompt=previous.prompt, prompt_token_ids=previous.prompt_token_ids,
            outputs=completions, finished=delta.finished, num_cached_tokens=delta.num_cached_tokens,
            error=delta.error, error_code=delta.error_code,
            metrics=RequestMetrics(*m) if m is not None else previous.metrics, tenant=previous.tenant,
            prompt_logprobs=prompt_logprobs)
        if delta.finished:
            self._outputs.pop(delta.request_id, None)
        else:
            self._outputs[delta.request_id] = out
        return out


def _applied(before: CompletionOutput | None, c: CompletionDelta) -> CompletionOutput:
    """One sample's output with its delta applied."""
    if before is None:
        text, token_ids, logprobs = c.text, c.token_ids, None
    else:
        text = before.text + c.text if c.text_offset == len(before.text) else before.text[:c.text_offset] + c.text
        token_ids = before.token_ids[:c.token_offset] + c.token_ids
        logprobs = before.logprobs
    if c.logprobs is not None:
        logprobs = (logprobs or [])[:c.logprobs_offset] + [
            {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()} for entry in c.logprobs]
    return CompletionOutput(c.index, text, token_ids, c.finish_reason, c.stop_reason, logprobs)


def refusal_error(refusal: tuple[str, str | None, str, str]) -> Exception:
    kind, param, message, code = refusal
    if kind == "invalid":
        error = InvalidRequestError(None, message, code)
        error.param = param
        return error
    return RuntimeError(message)
