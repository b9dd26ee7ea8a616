"""The step protocol between rank 0 and the tensor-parallel workers.

Rank 0 runs the scheduler; workers only mirror what a forward needs of each running request:
its token ids, its block ids and how many of its tokens are in the cache. Each step rank 0 sends
a ``StepMessage`` holding the difference since the last one::

    request first scheduled:  all its token ids (the prompt) and all its block ids
    every later step:         num_computed_tokens, num_new_tokens, tokens sampled since
                              (one per decode, or those kept of a verified run of drafts), blocks
                              allocated since (one per block_size tokens), the drafts it runs
    after preemption:         num_kept_blocks = 0, then the request's new block ids
    finished / aborted:       its id in finished_req_ids (the mirror is dropped)
    swap copies:              the step's (device block, host slot) pairs, which every rank
                              copies for its own heads before the forward (a step may be only that)

``StepMessageBuilder`` (rank 0) and ``RequestMirror`` (workers) are the two ends; a mirror fed
every message in order builds exactly the ForwardBatch rank 0 builds. Sampling stays on rank 0:
workers need a sampled token only as an input id. Synchronously, the next message carries it.
Under async scheduling the next step is built before the token reaches rank 0's host: the message
then counts it pending (``num_pending_tokens``), as rank 0's Request does, and each rank's runner
reads its id on the device from its token pool (``runner/persistent_batch.py``), which takes the
sampled ids rank 0 broadcasts after sampling (every step: it costs one small collective, and the
engine may switch between synchronous and async steps). Only committed ids are ever sent, so the
message after the commit carries the real id::

    rank 0 tokens:   [ ... t5 ] + 1 pending   message N+1: new_token_ids=[t5], num_pending_tokens=1
    mirror:          [ ... t5 ] + 1 pending   the pending input read from the token pool
    after commit:    [ ... t5 t6 ] + 1        message N+2: new_token_ids=[t6], num_pending_tokens=1
"""

from __future__ import annotations

from dataclasses import dataclass

from deepbatch.core.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True, slots=True)
class ScheduledRequestData:
    req_id: str
    num_computed_tokens: int  # tokens already in the cache, where this step's chunk starts
    num_new_tokens: int
    new_token_ids: list[int]  # committed token ids the workers have not seen (appended to the mirror)
    num_kept_blocks: int  # the mirror's block ids past this many are stale (0 after preemption)
    new_block_ids: list[int]  # appended after truncating to num_kept_blocks
    num_pending_tokens: int = 0  # 1: a sampled token follows whose id is still on the device
    prompt_logprobs_end: int = 0  # Request.prompt_logprobs_end: the rows whose logits every rank computes
    spec_token_ids: tuple[int, ...] = ()  # the drafts run after the newest token (speculative decoding)


@dataclass(frozen=True, slots=True)
class StepMessage:
    step: int  # 1-based; lets a worker check it missed nothing
    scheduled: list[ScheduledRequestData]
    finished_req_ids: list[str]  # applied before ``scheduled`` (an id may be reused afterwards)
    blocks_to_swap_out: list[tuple[int, int]] = ()
    blocks_to_swap_in: list[tuple[int, int]] = ()


@dataclass(frozen=True, slots=True)
class RunnerCallMessage:
    """Run ``ModelRunner.<method>(*args)`` on every worker, as rank 0 runs it on its own runner:
    start-up work outside the step loop whose collectives must meet rank 0's; with ``drafter``,
    the method of the worker's MTP runner instead."""

    method: str  # one of RUNNER_CALLS (DRAFTER_CALLS with drafter)
    args: tuple = ()
    drafter: bool = False


# What rank 0 may ask of a worker's runner between steps.
RUNNER_CALLS = frozenset({"init_swap_space", "measure_prefill_tokens_per_s"})
# ... and of its drafter (the MTP layer, sharded with the model): a forward of the drafts before a
# step, whose collectives meet rank 0's.
DRAFTER_CALLS = frozenset({"forward"})


@dataclass(frozen=True, slots=True)
class ShutdownMessage:
    """Leave the step loop and exit 0."""


class StepMessageBuilder:
    """Rank 0's record of what the workers know of each request."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, int]] = {}  # req id -> (committed token ids sent, block ids sent)
        self._finished: list[str] = []
        self._step = 0

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted: the next message tells the workers to drop it."""
        if self._known.pop(req_id, None) is not None:
            self._finished.append(req_id)

    def build(self, out: SchedulerOutput) -> StepMessage:
        known = self._known
        for r in out.preempted:  # its blocks went back to the pool; new ones will be sent
            if r.request_id in known:
                known[r.request_id] = (known[r.request_id][0], 0)
        scheduled = []
        for s in out.scheduled:
            r = s.request
            num_tokens, num_blocks = known.get(r.request_id, (0, 0))
            num_known = r.num_known_tokens
            scheduled.append(ScheduledRequestData(
                r.request_id, r.num_computed_tokens, s.num_new_tokens, r.all_token_ids[num_tokens:num_known],
                num_blocks, r.block_ids[num_blocks:], r.num_tokens - num_known, r.prompt_logprobs_end,
                tuple(r.spec_token_ids[:s.num_spec_tokens]),
            ))
            known[r.request_id] = (num_known, len(r.block_ids))
        self._step += 1
        finished, self._finished = self._finished, []
        return StepMessage(self._step, scheduled, finished, list(out.blocks_to_swap_out), list(out.blocks_to_swap_in))


class _MirroredRequest:
    """The fields of a Request that ``ModelRunner.build_batch`` reads."""

    __slots__ = ("request_id", "all_token_ids", "num_pending_tokens", "block_ids", "num_computed_tokens",
                 "prompt_logprobs_end", "spec_token_ids")
    sampling_params = None  # rank 0 samples: its runner alone keeps the parameters' rows

    def __init__(self, req_id: str):
        self.request_id = req_id
        self.all_token_ids: list[int] = []  # committed ids, as rank 0's Request holds them
        self.num_pending_tokens = 0
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.prompt_logprobs_end = 0
        self.spec_token_ids: list[int] = []  # this step's drafts only: the next message replaces them

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens


class RequestMirror:
    """A worker's view of the running requests, advanced by each ``StepMessage``."""

    def __init__(self) -> None:
        self._requests: dict[str, _MirroredRequest] = {}
        self._step = 0

    def __len__(self) -> int:
        return len(self._requests)

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        """Advance the mirror; returns the step as a SchedulerOutput over mirrored requests."""
        if msg.step != self._step + 1:
            raise RuntimeError(f"step message {msg.step} after {self._step}: the worker lost a message")
        self._step = msg.step
        for req_id in msg.finished_req_ids:
            self._requests.pop(req_id, None)
        scheduled = []
        for d in msg.scheduled:
            r = self._requests.get(d.req_id)
            if r is None:
                r = self._requests[d.req_id] = _MirroredRequest(d.req_id)
            r.all_token_ids.extend(d.new_token_ids)  # a token pending before is among them once committed
            r.num_pending_tokens = d.num_pending_tokens
            if d.num_kept_blocks > len(r.block_ids):
                raise RuntimeError(f"request {d.req_id!r}: keeps {d.num_kept_blocks} blocks of {len(r.block_ids)}")
            if d.num_kept_blocks < len(r.block_ids):
                # Blocks dropped (preemption): a new list, as the engine's own request gets, so the
                # runner's persistent batch sends the table whole (``runner/persistent_batch.py``).
                r.block_ids = r.block_ids[:d.num_kept_blocks]
            r.block_ids.extend(d.new_block_ids)
            r.num_computed_tokens = d.num_computed_tokens
            r.prompt_logprobs_end = d.prompt_logprobs_end
            r.spec_token_ids = list(d.spec_token_ids)
            scheduled.append(ScheduledRequest(r, d.num_new_tokens))  # type: ignore[arg-type]
        return SchedulerOutput(scheduled, blocks_to_swap_out=list(msg.blocks_to_swap_out),
                               blocks_to_swap_in=list(msg.blocks_to_swap_in))
