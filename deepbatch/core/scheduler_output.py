"""What the scheduler hands the runner each step: the requests and the token counts it scheduled,
the KV copies to make first, and what it preempted or ended. Shared by the scheduler (which builds
it), the runner and the tensor-parallel step messages (which read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepbatch.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this chunk reaches the request's newest token, so a token is sampled. Fixed
    # when scheduled: the request's counters move on before the step's tokens are committed.
    samples: bool = field(init=False)
    # Drafted tokens run after the newest one (speculative decoding): ``request.spec_token_ids``,
    # all of them, counted in ``num_new_tokens``.
    num_spec_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        r = self.request
        past_newest = r.num_computed_tokens + self.num_new_tokens - r.num_tokens
        self.samples = past_newest >= 0
        self.num_spec_tokens = max(past_newest, 0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # KV copies the runner performs before the forward, swap-outs first: (device block, host
    # slot) and (host slot, device block).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests ended by the scheduler itself (e.g. can never fit); already freed.
    finished: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
