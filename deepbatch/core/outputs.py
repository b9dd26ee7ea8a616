"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's logprob at one position, as vLLM gives prompt logprobs: ``rank`` is its place
    in the distribution (1 = most likely). ``decoded_token`` is left None by the engine (the
    server fills in the text it sends)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    # With ``SamplingParams.logprobs = k`` (vLLM's shape): one ``{token_id: Logprob}`` per
    # generated token, the sampled token first, then the k most likely (k or k + 1 entries);
    # ``rank`` is 1 + the number of more likely tokens. From the engine a ``SampleLogprobs``
    # (``core/logprobs.py``: each position's dict built when first read), which reads as a list.
    logprobs: Sequence[dict[int, Logprob]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(entry[t].logprob for t, entry in zip(self.token_ids, self.logprobs))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times the scheduler took its KV blocks away, over its samples


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # see Request.error_code
    metrics: RequestMetrics | None = None
    tenant: str = "default"
    # With ``SamplingParams.prompt_logprobs`` (vLLM's shape): one entry per prompt token, None
    # for the first (nothing precedes it), then ``{token_id: Logprob}`` holding the prompt
    # token itself and the top ``prompt_logprobs`` alternatives (k or k + 1 entries). Entries
    # appear as the prompt's chunks run; the list is complete once the first token is out.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
