"""AsyncEngine's waiting-queue bounds, request ids and Retry-After, against an engine whose
waiting queue drains at a known rate: a request larger than a bound is refused for good (never a
429 that no retry can cure), a full queue suggests a retry from the measured drain rate, and
caller-chosen ids never collide with one another or with the ids of a request's samples."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from deepbatch.engine.async_engine import AsyncEngine, QueueFullError
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.preemption import Preemptor


class QueueEngine:
    """LLMEngine's interface over a FIFO waiting queue: each step (``step_s`` long) admits up to
    ``admit`` waiting sequences, and an admitted sequence runs ``max_tokens`` steps."""

    model_name = "queue"
    tokenizer = None
    max_model_len = 1 << 20

    def __init__(self, admit: int = 1, step_s: float = 0.0):
        self.admit = admit
        self.step_s = step_s
        self.hf_config = SimpleNamespace(vocab_size=1000)
        self.stats = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0, num_steps=0)
        self.kv_cache = KVCacheManager(100, 16)
        # ``running`` stays empty: the snapshot walks real requests' KV blocks there.
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0, running=[], waiting=[],
                                         preemptor=Preemptor(self.kv_cache))
        self.admitted: list[SimpleNamespace] = []
        self.parents: dict[str, dict] = {}
        self.template_kwargs: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        self.template_kwargs.append(kwargs)
        return [1, 2, 3]

    def make_requests(self, request_id, prompt, params, priority=0, tenant="default", arrival_time=None):
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt)
        if not ids or any(not 0 <= t < 1000 for t in ids):
            raise InvalidRequestError("prompt", "token ids must be in [0, 1000)")
        return [SimpleNamespace(prompt_token_ids=ids, prompt=None)] * params.n

    def add_request(self, request_id, prompt, params, priority=0, tenant="default", arrival_time=None):
        ids = prompt["prompt_token_ids"]
        self.parents[request_id] = {"ids": ids, "n": params.n, "done": 0, "arrival": arrival_time}
        for _ in range(params.n):
            self.scheduler.waiting.append(SimpleNamespace(parent=request_id, num_tokens=len(ids),
                                                          num_computed_tokens=0, left=params.max_tokens))
        self._count()

    def abort_request(self, request_id):
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        self.scheduler.waiting = [s for s in self.scheduler.waiting if s.parent != request_id]
        self.admitted = [s for s in self.admitted if s.parent != request_id]
        self._count()
        return self._output(request_id, parent, "abort")

    def has_unfinished_requests(self):
        return bool(self.parents)

    def step(self):
        self.stats.num_steps += 1
        time.sleep(self.step_s)
        waiting = self.scheduler.waiting
        self.admitted += waiting[:self.admit]
        del waiting[:self.admit]
        outs = []
        for sample in list(self.admitted):
            sample.left -= 1
            if sample.left == 0:
                self.admitted.remove(sample)
                parent = self.parents[sample.parent]
                parent["done"] += 1
                if parent["done"] == parent["n"]:
                    del self.parents[sample.parent]
                    outs.append(self._output(sample.parent, parent, "length"))
        self._count()
        return outs

    def _count(self):
        self.scheduler.num_waiting = len(self.scheduler.waiting)

    @staticmethod
    def _output(request_id, parent, reason):
        return RequestOutput(request_id, None, parent["ids"], [CompletionOutput(0, "", [], reason)], finished=True,
                             metrics=RequestMetrics(parent["arrival"]))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def params(max_tokens: int = 1, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n)


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("n,prompts,param", [(5, 1, "n"), (2, 3, "prompt"), (1, 5, "prompt")])
def test_more_sequences_than_the_queue_holds_is_refused_for_good(n, prompts, param):
    engine = AsyncEngine(QueueEngine(), max_queued_requests=4)  # idle: an empty queue

    async def main():
        pairs = [(f"r{i}", [1, 2]) for i in range(prompts)]
        with pytest.raises(InvalidRequestError) as e:
            await engine.add_requests(pairs, params(n=n))
        assert (e.value.param, e.value.code) == (param, "exceeds_queue_limit")
        assert "4" in e.value.message and str(n * prompts) in e.value.message
        # Nothing was queued and every id is free again: the same ids fit with fewer sequences.
        assert engine.snapshot().num_waiting == 0 and engine.num_in_flight == 0
        await engine.add_requests(pairs[:1], params(n=1))

    run(main())
    engine.shutdown()


def test_more_prompt_tokens_than_the_queue_holds_is_refused_for_good():
    engine = AsyncEngine(QueueEngine(), max_queued_tokens=10)

    async def main():
        with pytest.raises(InvalidRequestError) as e:
            await engine.add_request("r", [1] * 6, params(n=2))  # 12 tokens > 10, even in an empty queue
        assert (e.value.param, e.value.code) == ("prompt", "exceeds_queue_limit")
        with pytest.raises(InvalidRequestError):  # prompts of one call count together
            await engine.add_requests([("a", [1] * 6), ("b", [1] * 6)], params())
        await engine.add_request("r", [1] * 10, params())  # exactly the bound fits

    run(main())
    engine.shutdown()


def test_one_bad_prompt_queues_none_of_the_call():
    engine = AsyncEngine(QueueEngine(), max_queued_requests=8)

    async def main():
        with pytest.raises(InvalidRequestError):
            await engine.add_requests([("a", [1]), ("b", [5000])], params())
        assert engine.snapshot().num_waiting == 0 and engine.num_in_flight == 0
        await engine.add_requests([("a", [1]), ("b", [2])], params())

    run(main())
    engine.shutdown()


def test_full_queue_without_a_measured_drain_suggests_the_fallback():
    engine = AsyncEngine(QueueEngine(), max_queued_requests=2)  # not started: nothing ever drains

    async def main():
        await engine.add_request("a", [1], params(n=2))
        with pytest.raises(QueueFullError) as e:
            await engine.add_request("b", [1], params())
        assert e.value.retry_after == 1.0

    run(main())
    engine.shutdown()


@pytest.mark.parametrize("bound", ["requests", "tokens"])
def test_retry_after_follows_the_measured_drain_rate(bound):
    # One 5-token sequence leaves the queue per 0.5 s step: 2 sequences/s, 10 tokens/s.
    step_s, prompt = 0.5, [1] * 5
    limits = {"max_queued_requests": 4} if bound == "requests" else {"max_queued_tokens": 20}
    fake = QueueEngine(admit=1, step_s=step_s)
    engine = AsyncEngine(fake, **limits)
    engine.start()

    async def main():
        # Fill the queue and let it drain, so the rate is measured; admitted sequences keep running.
        await engine.add_requests([(f"warm{i}", prompt) for i in range(4)], params(max_tokens=10_000))
        await wait_until(lambda: len(fake.admitted) == 4 and engine.snapshot().num_waiting == 0)
        await engine.add_requests([(f"wait{i}", prompt) for i in range(4)], params(max_tokens=10_000))
        # Room for 4 more sequences (20 tokens) takes 4 admissions, one per step; for 2, two.
        for n in (4, 2):
            with pytest.raises(QueueFullError) as e:
                await engine.add_request(f"late{n}", prompt, params(n=n))
            assert e.value.retry_after == pytest.approx(n * step_s, rel=0.25), (n, e.value.retry_after)

    run(main())
    engine.shutdown()


def test_retry_after_grows_while_the_queue_is_stuck():
    engine = AsyncEngine(QueueEngine(admit=0, step_s=0.02), max_queued_requests=1)
    engine.start()

    async def main():
        await engine.add_request("stuck", [1], params())
        await asyncio.sleep(2.0)  # two seconds of steps that admit nothing
        with pytest.raises(QueueFullError) as e:
            await engine.add_request("late", [1], params())
        # Nothing left in 2 s: fewer than one sequence per 2 s, so at least ~2 s to make room.
        assert e.value.retry_after >= 1.8, e.value.retry_after
        engine.abort("stuck")
        await wait_until(lambda: engine.num_in_flight == 0)

    run(main())
    engine.shutdown()


def test_request_ids_in_flight_include_the_samples():
    engine = AsyncEngine(QueueEngine(admit=8, step_s=0.01))
    engine.start()

    async def main():
        stream = await engine.add_request("kid", [1], params(max_tokens=10_000, n=2))  # samples kid-0, kid-1
        for taken in ("kid", "kid-1"):
            with pytest.raises(InvalidRequestError) as e:
                await engine.add_request(taken, [1], params())
            assert (e.value.param, e.value.code) == ("request_id", "duplicate_request_id")
        with pytest.raises(InvalidRequestError):  # a new parent whose samples would be named kid-0 ...
            await engine.add_request("kid-0", [1], params())
        engine.abort("kid")
        assert (await stream.result()).outputs[0].finish_reason == "abort"
        # Answered: every id is free again.
        for rid in ("kid", "kid-1"):
            assert (await (await engine.add_request(rid, [1], params())).result()).finished

    run(main())
    engine.shutdown()


def test_template_variables_may_share_names_with_the_engine_call():
    fake = QueueEngine()
    engine = AsyncEngine(fake)

    async def main():
        assert await engine.apply_chat_template([{"role": "user", "content": "x"}], fn=1, add=2) == [1, 2, 3]

    run(main())
    engine.shutdown()
    assert fake.template_kwargs == [{"fn": 1, "add": 2}]
