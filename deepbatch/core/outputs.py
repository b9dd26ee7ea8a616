"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    # One (logprob of the sampled token, {token_id: logprob} of the top-k) per token, if asked.
    logprobs: list[tuple[float, dict[int, float]]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp for lp, _ in self.logprobs)

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
