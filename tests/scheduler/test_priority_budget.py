"""Priority without inversion in the token budget: a waiting request that outranks running
prefills takes their chunk's budget in the very next step (they keep their progress), running
decodes keep their token, nobody is preempted for budget, and FCFS is unchanged.

The fake runner of ``test_scheduler`` checks every step's contract (limits, block tables, the
KV each context reads back). Its model samples a function of the whole context, so a request's
outputs are those of ``reference_outputs`` only if every chunk it was given was the right one,
however it was batched or cut.
"""

from __future__ import annotations

import itertools

from hypothesis import event, given, settings
from hypothesis import strategies as st

from deepbatch.config import SchedulerConfig
from deepbatch.core.request import Request, RequestStatus
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.scheduler import Scheduler
from test_scheduler import FakeRunner, by_id, make_request, prompt_of

STEP_S = 0.01  # simulated step time


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def context_model(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on every token of the context."""
    h = 17
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 10 + h % 5000


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(context_model(tokens))
    return tokens[len(prompt):]


def make(policy="priority", budget=256, num_blocks=512, block_size=16, max_num_seqs=64, aging_s=0.0):
    clock = Clock()
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                          priority_aging_s=aging_s)
    sched = Scheduler(cfg, KVCacheManager(num_blocks, block_size), 8192, clock=clock)
    return sched, clock, FakeRunner(sched, sample=lambda r: context_model(r.all_token_ids))


def step(runner: FakeRunner, clock: Clock):
    out, _ = runner.step()
    assert not out.preempted, "nobody is preempted for budget alone"
    clock.t += STEP_S
    return out


def drain(runner: FakeRunner, clock: Clock) -> None:
    for _ in range(1000):
        if not runner.sched.has_unfinished():
            break
        step(runner, clock)
    runner.run(max_steps=runner.num_steps)  # fails unless drained; checks every block is free


def arrive(sched: Scheduler, clock: Clock, rid: str, prompt: list[int], priority: int, max_tokens: int = 4) -> Request:
    r = make_request(rid, prompt, max_tokens=max_tokens, arrival=clock.t, priority=priority)
    sched.add_request(r)
    return r


def test_high_priority_arrival_cuts_a_2000_token_low_priority_prefill():
    sched, clock, runner = make(budget=256)
    low = arrive(sched, clock, "low", prompt_of(2000, 100), priority=5)
    step(runner, clock)
    step(runner, clock)
    assert low.num_computed_tokens == 512
    high = arrive(sched, clock, "high", prompt_of(40, 5000), priority=0)
    out = step(runner, clock)
    # Scheduled in the very next step with its whole prompt; the prefill gets the rest.
    assert by_id(out) == {"high": 40, "low": 216}
    assert high.output_token_ids == reference_outputs(high.prompt_token_ids, 1)  # first token: one step
    while not high.is_finished:
        out = step(runner, clock)
        assert by_id(out)["high"] == 1 and by_id(out)["low"] == 255
    drain(runner, clock)
    assert high.status == low.status == RequestStatus.FINISHED_LENGTH
    assert high.output_token_ids == reference_outputs(high.prompt_token_ids, 4)
    assert low.output_token_ids == reference_outputs(low.prompt_token_ids, 4)


def test_an_outranking_prompt_larger_than_the_budget_cuts_the_prefill_to_nothing():
    sched, clock, runner = make(budget=256)
    low = arrive(sched, clock, "low", prompt_of(2000, 100), priority=5)
    step(runner, clock)
    high = arrive(sched, clock, "high", prompt_of(300, 5000), priority=0)
    out = step(runner, clock)
    assert by_id(out) == {"high": 256}
    assert low.num_computed_tokens == 256 and len(low.block_ids) == 16  # progress and blocks kept
    out = step(runner, clock)
    assert by_id(out) == {"high": 44, "low": 212}
    assert high.num_output_tokens == 1  # its first token, two steps after it arrived
    drain(runner, clock)
    assert low.output_token_ids == reference_outputs(low.prompt_token_ids, 4)
    assert high.output_token_ids == reference_outputs(high.prompt_token_ids, 4)


def test_running_decodes_keep_their_token_when_prefills_are_cut():
    # Two low-priority requests decode; a third, also low, prefills a long prompt. The
    # high-priority arrival takes only what the decodes leave, all of the prefill's share.
    sched, clock, runner = make(budget=16)
    decoders = [arrive(sched, clock, f"d{i}", prompt_of(4, 100 * (i + 1)), priority=5, max_tokens=20) for i in range(2)]
    step(runner, clock)
    long = arrive(sched, clock, "long", prompt_of(100, 1000), priority=5)
    step(runner, clock)
    high = arrive(sched, clock, "high", prompt_of(40, 5000), priority=0)
    out = step(runner, clock)
    assert by_id(out) == {"d0": 1, "d1": 1, "high": 14}
    out = step(runner, clock)
    assert by_id(out) == {"d0": 1, "d1": 1, "high": 14}
    out = step(runner, clock)
    assert by_id(out) == {"d0": 1, "d1": 1, "high": 12, "long": 2}
    drain(runner, clock)
    for r in [*decoders, long, high]:
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.max_tokens)


def test_a_decode_keeps_its_token_behind_a_higher_ranked_prefill():
    sched, clock, runner = make(budget=16)
    low = arrive(sched, clock, "low", prompt_of(4, 100), priority=5, max_tokens=10)
    step(runner, clock)
    big = arrive(sched, clock, "big", prompt_of(100, 1000), priority=0)
    out = step(runner, clock)
    assert by_id(out) == {"low": 1, "big": 15}
    # Now both run, "big" first by rank; its chunk still leaves the decode its token.
    out = step(runner, clock)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("big", 15), ("low", 1)]
    drain(runner, clock)
    assert low.output_token_ids == reference_outputs(low.prompt_token_ids, 10)


def test_fcfs_keeps_serving_the_running_prefill_first():
    sched, clock, runner = make(policy="fcfs", budget=256)
    arrive(sched, clock, "low", prompt_of(2000, 100), priority=5)
    step(runner, clock)
    high = arrive(sched, clock, "high", prompt_of(40, 5000), priority=0)
    out = step(runner, clock)
    assert by_id(out) == {"low": 256}
    drain(runner, clock)
    assert high.first_scheduled_time >= 7 * STEP_S  # behind the whole 2,000-token prompt


def test_a_lower_priority_arrival_does_not_cut_a_running_prefill():
    sched, clock, runner = make(budget=256)
    arrive(sched, clock, "first", prompt_of(2000, 100), priority=1)
    step(runner, clock)
    arrive(sched, clock, "later", prompt_of(40, 5000), priority=3)
    out = step(runner, clock)
    assert by_id(out) == {"first": 256}
    drain(runner, clock)


def run_stream(aging_s: float, steps: int) -> Request:
    """A low-priority prefill under a stream of high-priority prompts that fill the budget."""
    sched, clock, runner = make(budget=32, aging_s=aging_s)
    low = arrive(sched, clock, "low", prompt_of(200, 100), priority=3)
    step(runner, clock)  # it is running, prefilling, when the stream begins
    for n in range(steps):
        arrive(sched, clock, f"h{n}", prompt_of(32, 1000 + 40 * n), priority=0, max_tokens=1)
        step(runner, clock)
        if low.is_finished:
            break
    return low


def test_aging_lets_a_cut_prefill_finish_under_a_stream_of_higher_priority():
    # Without aging strict priority cuts it forever; with aging (one level per 5 steps here) it
    # outranks newer arrivals after 15 steps and runs.
    assert run_stream(aging_s=0.0, steps=200).num_computed_tokens == 32
    low = run_stream(aging_s=5 * STEP_S, steps=200)
    assert low.is_finished
    assert low.output_token_ids == reference_outputs(low.prompt_token_ids, 4)


# -- everything at once ----------------------------------------------------------------------

ARRIVALS = st.lists(
    st.tuples(
        st.integers(0, 12),  # step it arrives before
        st.integers(1, 80),  # prompt length
        st.integers(1, 6),  # max_tokens
        st.integers(0, 3),  # priority
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=200, deadline=None)
@given(arrivals=ARRIVALS, budget=st.integers(1, 48), block_size=st.sampled_from([4, 16]),
       aging_s=st.sampled_from([0.0, 3 * STEP_S]))
def test_random_arrivals_never_wait_behind_lower_ranked_prefills(arrivals, budget, block_size, aging_s):
    # Blocks and seats for everyone at once, so only the budget decides who runs.
    num_blocks = sum(-(-(p + m) // block_size) for _, p, m, _ in arrivals)
    sched, clock, runner = make(budget=budget, num_blocks=num_blocks, block_size=block_size,
                                max_num_seqs=len(arrivals), aging_s=aging_s)
    ids = itertools.count()
    pending = sorted(arrivals, key=lambda a: a[0])
    reqs: list[Request] = []
    policy = sched.policy
    for n in range(5000):
        while pending and pending[0][0] <= n:
            _, p, m, prio = pending.pop(0)
            i = next(ids)
            reqs.append(arrive(sched, clock, f"r{i}", prompt_of(p, 1000 * (i + 1)), prio, max_tokens=m))
        if not pending and not sched.has_unfinished():
            break
        todo = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        now = clock.t
        out = step(runner, clock)
        prefills = [s.request for s in out.scheduled if todo.get(s.request.request_id, 0) > 1]
        for w in sched.waiting:
            for p in prefills:
                assert not policy.key(w, now) < policy.key(p, now), (
                    f"{w.request_id} waits while {p.request_id}, ranked below it, prefills")
        if prefills and len(out.scheduled) > len(prefills):
            event("prefill chunks beside other requests")
    assert not pending and not sched.has_unfinished(), "a request starved"
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_outputs(r.prompt_token_ids, r.max_tokens)
        assert r.first_scheduled_time is not None
