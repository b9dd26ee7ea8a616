"""The ingress's engine client against scripted replicas (no Ray): retries before streaming,
clear errors after, rollback moving queued canary requests, all-or-none submission."""

from __future__ import annotations

import asyncio

import pytest

from deepbatch.api.errors import APIError
from deepbatch.engine.admission import QueueFullError
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, RequestOutput
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.serve_ray.client import ArmObserver, RoutedEngineClient
from deepbatch.serve_ray.protocol import Accepted, Refusal
from deepbatch.serve_ray.rollout import CANARY, STABLE, RolloutController
from deepbatch.serve_ray.rollout_spec import parse_spec


class Cancelled(Exception):
    """What Serve raises from a cancelled response generator."""


class FakeResponse:
    """A DeploymentResponseGenerator over a scripted async generator."""

    def __init__(self, agen):
        self.agen = agen
        self.cancelled = asyncio.Event()

    def cancel(self):
        self.cancelled.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled.is_set():
            raise Cancelled()
        step = asyncio.ensure_future(self.agen.__anext__())
        cancel = asyncio.ensure_future(self.cancelled.wait())
        await asyncio.wait({step, cancel}, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            step.cancel()
            raise Cancelled()
        cancel.cancel()
        return step.result()


class FakeHandle:
    """``handle.options(stream=True).generate.remote(call)`` running ``script(call, n)``."""

    def __init__(self, script):
        self.script = script
        self.calls = []
        self.responses = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, call):
        self.calls.append(call)
        response = FakeResponse(self.script(call, len(self.calls)))
        self.responses.append(response)
        return response


def output(n_tokens: int, finished: bool = False, error: str | None = None) -> RequestOutput:
    return RequestOutput("x", None, [], [CompletionOutput(0, "t" * n_tokens, list(range(n_tokens)),
                                                          "length" if finished else None)],
                         finished=finished, error=error)


async def healthy(call, n):
    yield Accepted("r")
    for i in range(1, 4):
        await asyncio.sleep(0)
        yield output(i, finished=i == 3)


class Frontend:
    model_name = "m"
    max_model_len = 64
    tokenizer = None

    def prompt_ids(self, prompt):
        return None, list(prompt)


class Recorder(ArmObserver):
    def __init__(self):
        self.events = []

    def first_token(self, arm, ttft):
        self.events.append(("first_token", arm))

    def finished(self, arm, error, e2e=None, tpot=None):
        self.events.append(("error" if error else "ok", arm))

    def retried(self, arm):
        self.events.append(("retried", arm))

    def moved(self):
        self.events.append(("moved", None))


def make_client(stable_script, canary_script, percent: float = 100, max_attempts: int = 3):
    rollout = RolloutController(parse_spec({"steps": sorted({percent, 100})}), has_canary=True)
    handles = {STABLE: FakeHandle(stable_script), CANARY: FakeHandle(canary_script)}
    recorder = Recorder()
    client = RoutedEngineClient(Frontend(), handles, {STABLE: 2, CANARY: 2}, rollout, recorder, max_attempts)
    return client, handles, recorder, rollout


async def final(stream):
    return await stream.result()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


PARAMS = SamplingParams(max_tokens=3)


def test_canary_failure_before_accepting_is_retried_on_stable():
    async def broken(call, n):
        raise RuntimeError("replica exploded")
        yield  # makes this an async generator

    async def main():
        client, handles, recorder, _ = make_client(healthy, broken)
        [stream] = await client.add_requests([("cmpl-1", [1, 2, 3, 4, 5])], PARAMS, tenant="alice")
        out = await final(stream)
        assert out.finished and out.outputs[0].token_ids == [0, 1, 2] and out.prompt_token_ids == [1, 2, 3, 4, 5]
        assert [c.request_id for c in handles[CANARY].calls] == ["cmpl-1"]
        assert [c.request_id for c in handles[STABLE].calls] == ["cmpl-1-retry1"]
        assert handles[STABLE].calls[0].block_hashes and handles[STABLE].calls[0].session == "alice"
        assert recorder.events == [("error", CANARY), ("retried", CANARY), ("first_token", STABLE), ("ok", STABLE)]

    run(main())


def test_failure_before_the_first_token_is_retried_after_it_is_not():
    async def fails_early(call, n):
        yield Accepted("c")
        yield output(0, finished=True, error="sampler failed")

    async def fails_late(call, n):
        yield Accepted("s")
        yield output(1)
        raise RuntimeError("ActorDiedError: the actor died unexpectedly")

    async def main():
        client, handles, recorder, _ = make_client(fails_late, fails_early)
        [stream] = await client.add_requests([("cmpl-2", [1, 2])], PARAMS, tenant="bob")
        first = await stream.__anext__()
        assert first.outputs[0].token_ids == [0]
        with pytest.raises(APIError) as e:
            await stream.__anext__()
        assert e.value.status == 503 and e.value.code == "replica_failed"
        assert "failed mid-stream" in e.value.message and "ActorDiedError" in e.value.message
        assert len(handles[CANARY].calls) == 1 and len(handles[STABLE].calls) == 1  # no retry once streaming
        assert recorder.events == [("error", CANARY), ("retried", CANARY), ("first_token", STABLE), ("error", STABLE)]

    run(main())


def test_rollback_moves_canary_requests_that_have_not_started():
    async def queued(call, n):
        yield Accepted("c")
        await asyncio.Event().wait()  # never scheduled
        yield output(1)

    async def main():
        client, handles, recorder, rollout = make_client(healthy, queued)
        [stream] = await client.add_requests([("cmpl-3", [1, 2, 3])], PARAMS, tenant="carol")
        await asyncio.sleep(0.05)
        assert not stream.finished
        rollout.rollback("test")
        out = await final(stream)
        assert out.finished and out.outputs[0].token_ids == [0, 1, 2]
        assert handles[CANARY].responses[0].cancelled.is_set()
        assert recorder.events == [("moved", None), ("first_token", STABLE), ("ok", STABLE)]
        # A move is not a try: the stable attempt keeps the request's own id.
        assert [c.request_id for c in handles[STABLE].calls] == ["cmpl-3"]

    run(main())


def test_submission_is_all_or_none_and_refusals_keep_their_meaning():
    async def refuses_long(call, n):
        if len(call.prompt["prompt_token_ids"]) > 3:
            yield Refusal.of(InvalidRequestError("max_tokens", "too long", code="context_length_exceeded"))
            return
        yield Accepted("s")
        await asyncio.Event().wait()
        yield output(1)

    async def full(call, n):
        yield Refusal.of(QueueFullError("the queue is full", 7.0))

    async def main():
        client, handles, recorder, _ = make_client(refuses_long, refuses_long, percent=100)
        with pytest.raises(InvalidRequestError) as e:
            await client.add_requests([("cmpl-4", [1, 2]), ("cmpl-5", [1, 2, 3, 4, 5])], PARAMS)
        assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
        assert str(e.value) == "max_tokens: too long"
        accepted = [r for h in handles.values() for r in h.responses]
        assert all(r.cancelled.is_set() for r in accepted)  # the accepted one does not run on unread
        assert client.num_in_flight == 0
        client2, handles2, _, _ = make_client(full, full, max_attempts=2)
        with pytest.raises(QueueFullError) as e2:
            await client2.add_requests([("cmpl-4", [1])], PARAMS)  # the id is free again, too
        assert e2.value.retry_after == 7.0 and len(handles2[STABLE].calls) + len(handles2[CANARY].calls) == 2
        assert recorder.events == []  # the client's mistake is no replica's error

    run(main())


def test_attempts_spent_is_a_clear_503_and_abort_cancels():
    async def broken(call, n):
        raise ConnectionError("no route to replica")
        yield  # makes this an async generator

    async def slow(call, n):
        yield Accepted("s")
        await asyncio.Event().wait()
        yield output(1)

    async def main():
        client, handles, recorder, _ = make_client(broken, broken, max_attempts=3)
        with pytest.raises(APIError) as e:
            await client.add_requests([("cmpl-6", [1])], PARAMS, tenant="dave")
        assert e.value.status == 503 and e.value.code == "replica_unavailable"
        assert "3 attempt(s)" in e.value.message and "no route to replica" in e.value.message
        assert [arm for kind, arm in recorder.events if kind == "error"] == [CANARY, STABLE, STABLE]
        client2, handles2, _, _ = make_client(slow, slow)
        [stream] = await client2.add_requests([("cmpl-7", [1])], PARAMS, tenant="erin")
        client2.abort("cmpl-7")
        await asyncio.sleep(0.05)
        assert handles2[CANARY].responses[0].cancelled.is_set() and client2.num_in_flight == 0

    run(main())


def test_a_request_failing_on_stable_is_its_own_failure_not_retried():
    async def fails(call, n):
        yield Accepted("s")
        yield output(0, finished=True, error="sampling failed for this request")

    async def main():
        client, handles, recorder, _ = make_client(fails, fails, percent=1)
        [stream] = await client.add_requests([("cmpl-8", [1])], PARAMS, tenant="user-3")
        out = await final(stream)
        assert out.error == "sampling failed for this request"  # answered as one process answers it (500)
        assert len(handles[STABLE].calls) == 1 and not handles[CANARY].calls
        assert recorder.events == [("error", STABLE)]  # no token, no time to first token

    run(main())
