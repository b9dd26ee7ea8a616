"""One request, carrying its own state from arrival to finish.

Phase is derived from counters, never stored beside them::

    all_token_ids:  [ prompt ............ | output ...... ]
                    0        num_computed_tokens          num_tokens
                    |<- KV in cache ->|<- still to run ->|

A request is "prefilling" while ``num_computed_tokens < num_prompt_tokens`` and decoding once
only the newest sampled token is left to run (``num_tokens - num_computed_tokens == 1``).

With async scheduling the newest token may still be on the device when the next step is
scheduled: it is then counted (``num_pending_tokens == 1``, in ``num_tokens`` and
``num_output_tokens``) but not yet in the id lists, which hold known ids only; the runner feeds it
to the next step from its device token pool (``runner/persistent_batch.py``) and the engine appends
the id when it commits the step. Only the newest token can be pending.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepbatch.core.logprobs import SampleLogprobs
from deepbatch.core.outputs import Logprob
from deepbatch.core.sampling_params import SamplingParams

class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None here
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower is served first (vLLM's convention)
    tenant: str = "default"
    prompt: str | None = None
    # For n > 1, each sample is its own Request; they share ``parent_id`` and differ in ``index``.
    parent_id: str | None = None
    index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the request's full blocks, extended as tokens become known.
    block_hashes: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    # What kind of fault ``error`` is: None for a failure of this request's processing (HTTP 500),
    # "invalid_grammar" for a grammar the model's vocabulary cannot complete (the request's input: 400).
    error_code: str | None = None
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # 0 or 1: a sampled token counted but not yet in the id lists
    # Speculative decoding: the tokens drafted for the next step (``spec_decode/``), run after the
    # newest token and verified by the sampler; never part of the id lists until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Per draft position j: how often this request ran a draft there, and how often it was
    # accepted (with the drafts before it); the cost model's view of this request.
    spec_drafted: list[int] = field(default_factory=list)
    spec_accepted: list[int] = field(default_factory=list)
    # Per-token logprobs (CompletionOutput's shape): {token_id: Logprob}, the sampled token first;
    # kept as rows of the steps' tables until read (``core/logprobs.py``).
    logprobs: SampleLogprobs | None = None
    # With ``prompt_logprobs``, RequestOutput's list as far as the prompt has run: None for the
    # first prompt token, then ``{token_id: Logprob}`` per prompt token (``record_prompt_logprobs``).
    # The samples of one prompt (n > 1) share it, so only the first (``index`` 0) computes it;
    # the others may take prefix-cache hits. None when not asked, and on those others.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    # Detokenized output and the incremental decoder's state (owned by the engine's detokenizer).
    output_text: str = ""
    detok_state: object | None = field(default=None, repr=False)
    # The grammar's matcher state (``structured_output.matcher.StructuredOutputRequest``) while the
    # request runs with structured outputs; dropped when it finishes.
    structured_output: object | None = field(default=None, repr=False)

    # Timestamps for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = SampleLogprobs()
        if self.sampling_params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]
        # Positions below this have a prompt token next, whose logprob the runner computes from
        # the position's logits: every prompt position but the last, or none (0). A plain
        # attribute, read for each prefill chunk (a tensor-parallel worker's mirror has it too).
        self.prompt_logprobs_end = self.num_prompt_tokens - 1 if self.prompt_logprobs is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (all but a pending one)."""
        return len(self.all_token_ids)

    def record_prompt_logprobs(self, start: int, entries: list[tuple[float, int, dict[int, float]]]) -> None:
        """Take a prefill chunk's prompt logprobs (``SamplerOutput.prompt_logprobs``): entry ``j``
        is position ``start + j``'s ``(logprob of the next prompt token, its rank, {token_id:
        logprob} of the top alternatives)``. Positions already recorded are skipped: a chunk run
        again after preemption by recompute reports them a second time."""
        recorded = self.prompt_logprobs
        skip = len(recorded) - 1 - start  # the list holds positions [0, len - 1)
        if skip < 0:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs from position {start} after only "
                               f"{len(recorded) - 1} positions")
        prompt = self.prompt_token_ids
        for j in range(skip, len(entries)):
            logprob, rank, top = entries[j]
            # The prompt token first (as vLLM lists it), then the alternatives, ranked by order.
            position = {prompt[start + j + 1]: Logprob(logprob, rank)}
            for i, (t, v) in enumerate(top.items()):
                position.setdefault(t, Logprob(v, i + 1))
            recorded.append(position)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_pending_token(self) -> None:
        assert self.num_pending_tokens == 0, "only the newest token can be pending"
        self.num_pending_tokens = 1

    def commit_pending_token(self, token_id: int) -> None:
        assert self.num_pending_tokens == 1
        self.num_pending_tokens = 0
        self.append_output_token(token_id)
