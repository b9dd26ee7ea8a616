"""The API process's copy of each request's output, rebuilt from the engine core's deltas
(``core_messages.OutputDelta``): what a stream, an observer and a final reply read. The text is
made here, off the core's loop: detokenization and stop strings are per-token Python work that
would otherwise share the interpreter lock with scheduling the next step."""

from __future__ import annotations

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.engine.core_messages import CompletionDelta, FinishSample, OutputDelta
from deepbatch.engine.detokenizer import Detokenizer


class OutputAssembler:
    """Each request's cumulative ``RequestOutput``, rebuilt from the core's deltas, with its text:
    the core sends token ids only, and this side detokenizes them and looks for stop strings
    (``Detokenizer``, as the engine does in one process). A sample whose text meets a stop string
    (or cannot be decoded) is finished here at once, its later tokens dropped, and ``apply``
    returns the ``FinishSample`` to send so that the core stops it too."""

    def __init__(self, tokenizer=None, fault_request_id: str | None = None) -> None:
        """``fault_request_id``: testing only (``Detokenizer``)."""
        self._detokenizer = Detokenizer(tokenizer, fault_request_id)
        self._outputs: dict[str, RequestOutput] = {}  # parent id -> its output so far
        self._params: dict[str, SamplingParams] = {}  # parent id -> what its text follows
        self._texts: dict[tuple[str, int], _SampleText] = {}  # (parent id, sample index) -> its text
        self._errors: dict[str, str] = {}  # parent id -> a sample's text that failed here

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], tenant: str,
            params: SamplingParams | None = None) -> None:
        """A request sent to the core: what its deltas are applied to (they carry no prompt)."""
        self._outputs[request_id] = RequestOutput(request_id, prompt, prompt_token_ids, tenant=tenant)
        if params is not None:
            self._params[request_id] = params

    def drop(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)
        self._forget(request_id)

    def clear(self) -> None:
        self._outputs.clear()
        self._params.clear()
        self._texts.clear()
        self._errors.clear()

    def apply(self, delta: OutputDelta) -> tuple[RequestOutput, list[FinishSample]]:
        """The request's cumulative output with ``delta`` applied (a new object each time: a
        stream holds the newest output and a reader may still be looking at the previous one),
        and the samples it finished here."""
        rid = delta.request_id
        previous = self._outputs.get(rid)
        if previous is None:  # not added here (cannot happen while the link is whole): no prompt to carry
            previous = RequestOutput(rid, None, [])
        finishes: list[FinishSample] = []
        params = self._params.get(rid)
        before = previous.outputs
        if len(delta.completions) == 1 and len(before) <= 1:  # one sample: no index map needed
            completions = [self._applied(rid, params, before[0] if before else None, delta.completions[0], finishes)]
        else:
            by_index = {c.index: c for c in before}
            for c in delta.completions:
                by_index[c.index] = self._applied(rid, params, by_index.get(c.index), c, finishes)
            completions = [by_index[i] for i in sorted(by_index)]
        prompt_logprobs = previous.prompt_logprobs
        if delta.prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs or [])[:delta.prompt_logprobs_offset] + [
                None if entry is None else {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()}
                for entry in delta.prompt_logprobs]
        m = delta.metrics
        out = RequestOutput(
            request_id=rid, prompt=previous.prompt, prompt_token_ids=previous.prompt_token_ids,
            outputs=completions, finished=delta.finished, num_cached_tokens=delta.num_cached_tokens,
            error=delta.error or self._errors.get(rid), error_code=delta.error_code,
            metrics=RequestMetrics(*m) if m is not None else previous.metrics, tenant=previous.tenant,
            prompt_logprobs=prompt_logprobs)
        if delta.finished:
            self._outputs.pop(rid, None)
            self._forget(rid)
        else:
            self._outputs[rid] = out
        return out, finishes

    def _forget(self, request_id: str) -> None:
        params = self._params.pop(request_id, None)
        self._errors.pop(request_id, None)
        for index in range(params.n if params is not None else 0):
            self._texts.pop((request_id, index), None)

    def _applied(self, rid: str, params: SamplingParams | None, before: CompletionOutput | None,
                 c: CompletionDelta, finishes: list[FinishSample]) -> CompletionOutput:
        """One sample's output with its delta applied, its text extended by the new tokens."""
        if before is not None and before.finish_reason is not None:
            return before  # finished here (a stop string) or by the core: later tokens are not used
        token_ids = c.token_ids if before is None else before.token_ids[:c.token_offset] + c.token_ids
        logprobs = None if before is None else before.logprobs
        if c.logprobs is not None:
            logprobs = (logprobs or [])[:c.logprobs_offset] + [
                {t: Logprob(lp, rank) for t, (lp, rank) in entry.items()} for entry in c.logprobs]
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if params is None:  # without its parameters (a request not added here) there is no text
            return CompletionOutput(c.index, before.text if before else "", token_ids, finish_reason, stop_reason,
                                    logprobs)
        state = self._texts.get((rid, c.index))
        if state is None:
            state = self._texts[(rid, c.index)] = _SampleText(rid, params)
        for j, token in enumerate(c.token_ids):
            try:
                stop = self._detokenizer.update(state, [token])
            except Exception as e:  # noqa: BLE001 - a token this sample's text cannot take ends it alone
                message = f"detokenization failed: {type(e).__name__}: {e}"[:500]
                self._errors[rid] = message
                if finish_reason is None or j < len(c.token_ids) - 1:
                    finish_reason, stop_reason = "error", None
                    finishes.append(FinishSample(rid, c.index, None, message))
                token_ids = token_ids[:len(token_ids) - len(c.token_ids) + j + 1]
                break
            if stop is not None and (finish_reason is None or j < len(c.token_ids) - 1):
                # The core stops at stop ids and lengths first, as in one process; a stop string
                # ends the sample here, at the token that completed it.
                finish_reason, stop_reason = "stop", stop
                finishes.append(FinishSample(rid, c.index, stop))
                token_ids = token_ids[:len(token_ids) - len(c.token_ids) + j + 1]
                break
        if logprobs is not None and len(logprobs) > len(token_ids):
            logprobs = logprobs[:len(token_ids)]
        return CompletionOutput(c.index, state.output_text, token_ids, finish_reason, stop_reason, logprobs)


class _SampleText:
    """One sample's text and decoder state, as ``Detokenizer.update`` reads them off a request."""

    __slots__ = ("request_id", "parent_id", "sampling_params", "output_text", "detok_state")

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = self.parent_id = request_id
        self.sampling_params = params
        self.output_text = ""
        self.detok_state = None


def refusal_error(refusal: tuple[str, str | None, str, str]) -> Exception:
    kind, param, message, code = refusal
    if kind == "invalid":
        error = InvalidRequestError(None, message, code)
        error.param = param
        return error
    return RuntimeError(message)
