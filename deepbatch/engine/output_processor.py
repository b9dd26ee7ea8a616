"""The one place where a sampled token becomes output, and where "finished" is decided.

For each token a step sampled, in this order::

    record it           fills the request's pending token (async scheduling) or appends it
    stop ids, length    EOS (unless ignore_eos), stop_token_ids (after min_tokens), max_tokens
    detokenize          the text so far; a stop string truncates it and stops the request
    grammar             structured output advances its matcher; a completed grammar stops it
    logprobs            the sampled token's and the top ones, if asked; prompt logprobs as
                        each prefill chunk runs

A request that ran drafts (speculative decoding) has a list of tokens for the step: its accepted
drafts and one more, taken one by one until one ends it.

A request that ends here is removed from the scheduler (its blocks freed at once) and its
per-request state released. Outputs are built per parent request (``n`` samples share one).
The scheduler never decides that a request is done, except when it can never fit in the KV
cache; the engine hands those here through ``on_finished``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepbatch.core.request import Request, RequestStatus
from deepbatch.engine.detokenizer import Detokenizer
from deepbatch.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Monotonic counters since start (the metrics exporter reads deltas of these)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # Speculative decoding (vLLM's spec_decode counters): requests-steps that ran drafts, the
    # drafts, the accepted ones, and how often draft j was accepted; and how often a draft j ran
    # (the cost model's denominator, control/spec_cost.py).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_drafted_per_position: list[int] = field(default_factory=list)
    finished_by_reason: dict[str, int] = field(default_factory=dict)


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The stop condition that the newest token ``token`` meets, if any (stop strings and
    grammars are checked after detokenization)."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in params._eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


@dataclass
class StepResult:
    """What one committed step changed: the parents to report, and for the SLO controller the
    requests that got their first token and those that finished normally."""

    touched: dict[str, None] = field(default_factory=dict)  # parent ids, in order
    first_token: list[Request] = field(default_factory=list)
    done: list[Request] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, max_model_len: int, stats: EngineStats,
                 release: Callable[[str], None], detokenize: bool = True, fault_request_id: str | None = None):
        """``detokenize`` False: no text and no stop strings here (the engine core process, whose
        API processes do both and end a sample with ``finish_sample``)."""
        self.scheduler = scheduler
        self.detokenizer = Detokenizer(tokenizer, fault_request_id) if detokenize else None
        self.max_model_len = max_model_len
        self.stats = stats
        self._release = release  # drops the runner's per-request state
        self.parents: dict[str, list[Request]] = {}  # parent id -> its n samples

    # -- requests ---------------------------------------------------------------------------

    def add(self, requests: list[Request]) -> str:
        """Track the samples of one parent request; returns its id."""
        parent = requests[0].parent_id
        if parent in self.parents:
            raise InvalidRequestError("request_id", f"request id {parent!r} is already in use")
        self.parents[parent] = requests
        return parent

    def abort(self, parent_id: str) -> RequestOutput | None:
        """End a parent request (all its samples) now; its final output."""
        children = self.parents.pop(parent_id, None)
        if children is None:
            return None
        for r in children:
            if not r.is_finished:
                self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
                self.on_finished(r)
        return make_output(parent_id, children)

    # -- a step's tokens ----------------------------------------------------------------------

    def process(self, sampled: list[Request], token_ids: list[int | list[int]], logprobs,
                errors: dict[int, str] | None, now: float, result: StepResult,
                token_rows: dict[int, list[int]] | None = None) -> None:
        """Take one step's sampled tokens (row ``i`` belongs to ``sampled[i]``; a list where the
        request ran drafts: the tokens it keeps, their ``logprobs`` rows in ``token_rows[i]``)."""
        errors = errors or {}
        for i, (r, token) in enumerate(zip(sampled, token_ids)):
            if r.is_finished:
                continue  # stopped or aborted while this step ran; its token is dropped
            result.touched[r.parent_id] = None
            if i in errors:
                self.fail(r, errors[i])
                continue
            if type(token) is list:
                self._take_verified(r, token, token_rows[i], logprobs, now, result)
            else:
                self._take(r, token, i, logprobs, now, result)

    def _take_verified(self, r: Request, tokens: list[int], rows: list[int], logprobs, now: float,
                       result: StepResult) -> None:
        """A drafting request's tokens, in order until one ends it. Its drafts' KV was written
        for every draft; only the accepted ones count as computed (the next step overwrites the
        rest), so the newest token is again the one left to run."""
        stats, num_drafts, accepted = self.stats, len(r.spec_token_ids), len(tokens) - 1
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += num_drafts
        stats.spec_num_accepted_tokens += accepted
        for per_position, n in ((stats.spec_accepted_per_position, accepted),
                                (stats.spec_drafted_per_position, num_drafts),
                                (r.spec_accepted, accepted), (r.spec_drafted, num_drafts)):
            per_position.extend([0] * (n - len(per_position)))
            for j in range(n):
                per_position[j] += 1
        r.spec_token_ids = []
        for token, row in zip(tokens, rows):
            self._take(r, token, row, logprobs, now, result)
            if r.is_finished:
                return
        r.num_computed_tokens = r.num_tokens - 1

    def _take(self, r: Request, token: int, i: int, logprobs, now: float, result: StepResult) -> None:
        """One token of ``r`` (``i``: its row of ``logprobs``)."""
        self.stats.num_generation_tokens += 1
        if r.num_pending_tokens:
            r.commit_pending_token(token)
        else:  # a synchronous step: the token was not counted yet
            r.append_output_token(token)
        if r.first_token_time is None:
            r.first_token_time = now
            result.first_token.append(r)
        r.last_token_time = now
        if logprobs is not None and r.logprobs is not None:
            r.logprobs.append_row(logprobs, i)
        status = self._stop_status(r, token)
        if status is None or r.is_finished:  # r.is_finished: it failed in _stop_status
            return
        self.scheduler.finish_request(r.request_id, status)
        self.on_finished(r)
        result.done.append(r)

    def record_prompt_logprobs(self, prompt_logprobs) -> None:
        """A step's prompt logprobs (``SamplerOutput.prompt_logprobs``), from chunks that need
        not sample, onto their requests; a request that ended meanwhile drops them."""
        for request_id, (start, entries) in (prompt_logprobs or {}).items():
            r = self.scheduler.requests.get(request_id)
            if r is not None and r.prompt_logprobs is not None:
                r.record_prompt_logprobs(start, entries)

    def finish_sample(self, parent_id: str, index: int, stop_reason: str | None,
                      error: str | None = None) -> list[Request] | None:
        """End sample ``index`` of a parent request as stopped by ``stop_reason`` (a stop string
        found in its text elsewhere) or failed with ``error``; the parent's samples, or None when
        it is no longer tracked. A sample that already ended is left as it is; a parent whose
        samples have all ended is no longer tracked (no later step reports it)."""
        children = self.parents.get(parent_id)
        if children is None:
            return None
        for r in children:
            if r.index != index or r.is_finished:
                continue
            if error is not None:
                self.fail(r, error)
            else:
                r.stop_reason = stop_reason
                self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
                self.on_finished(r)
        if all(r.is_finished for r in children):
            del self.parents[parent_id]
        return children

    def _stop_status(self, r: Request, token: int) -> RequestStatus | None:
        status = check_stop(r, token, self.max_model_len)
        if self.detokenizer is None:
            return self._grammar_status(r, status)
        try:
            stop = self.detokenizer.update(r, [token])
        except Exception as e:  # noqa: BLE001 - a token this request's text cannot take ends it alone
            message = f"detokenization failed: {type(e).__name__}: {e}"[:500]
            if status is None:
                self.fail(r, message)
            else:  # it had just finished (length, stop id): it keeps its reason
                r.error = message
            return status
        if stop is not None and status is None:
            r.stop_reason = stop
            return RequestStatus.FINISHED_STOPPED
        return self._grammar_status(r, status)

    def _grammar_status(self, r: Request, status: RequestStatus | None) -> RequestStatus | None:
        if status is None and r.structured_output is not None:
            error = r.structured_output.advance(r.output_token_ids, r.num_pending_tokens)
            if error is not None:
                self.fail(r, error, r.structured_output.error_code)
                return None
            if r.structured_output.is_terminated:  # the grammar took a stop token: complete
                return RequestStatus.FINISHED_STOPPED
        return status

    def fail(self, r: Request, message: str, code: str | None = None) -> None:
        """End one request with an error (its own fault); the engine and the rest go on."""
        logger.warning("request %s failed: %s", r.request_id, message)
        r.error = message
        r.error_code = code
        self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_ERROR)
        self.on_finished(r)

    def on_finished(self, r: Request) -> None:
        """Release what a finished request holds beyond its KV blocks (already freed)."""
        self._release(r.request_id)
        if r.structured_output is not None:
            r.structured_output.release()
            r.structured_output = None
        reason = r.finish_reason or "abort"
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1

    # -- outputs ----------------------------------------------------------------------------

    def collect(self, parent_ids, finished_only: bool = False) -> list[RequestOutput]:
        """An output per parent in ``parent_ids`` (with ``finished_only``, only for those whose
        samples all finished: offline runs skip building the rest); finished ones are dropped."""
        return [make_output(pid, children) for pid, children in self.take(parent_ids, finished_only)]

    def take(self, parent_ids, finished_only: bool = False) -> list[tuple[str, list[Request]]]:
        """``(parent id, its samples)`` for each of ``parent_ids`` still tracked (with
        ``finished_only``, only those whose samples all finished); finished ones are dropped."""
        taken = []
        for pid in parent_ids:
            children = self.parents.get(pid)
            if children is None or (finished_only and not all(r.is_finished for r in children)):
                continue
            if all(r.is_finished for r in children):
                del self.parents[pid]
            taken.append((pid, children))
        return taken


def parent_state(children: list[Request]) -> tuple[bool, int, str | None, str | None, RequestMetrics]:
    """What a parent request's output says beside its samples: finished, prefix-cache hit,
    error and its code (the first sample's that failed), metrics over its samples."""
    first = children[0]
    failed = next((r for r in children if r.error), None)
    metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                             max((r.finished_time or 0.0) for r in children) or None,
                             sum(r.num_preemptions for r in children))
    return (all(r.is_finished for r in children), max(first.num_cached_tokens, 0),
            failed.error if failed else None, failed.error_code if failed else None, metrics)


def make_output(parent_id: str, children: list[Request]) -> RequestOutput:
    first = children[0]
    completions = [
        CompletionOutput(r.index, r.output_text, r.output_token_ids[:],
                         r.finish_reason, r.stop_reason,
                         r.logprobs.copy() if r.logprobs is not None else None)
        for r in children
    ]
    finished, num_cached, error, error_code, metrics = parent_state(children)
    return RequestOutput(
        request_id=parent_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=num_cached,
        error=error,
        error_code=error_code,
        prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
        metrics=metrics,
        tenant=first.tenant,
    )
