"""AsyncEngine against a fake LLMEngine (no model): threading contract, queue bound, aborts,
drain and death. Fast, so every edge of the contract is checked without a server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from apitest_fakes import FakeEngine
from deepbatch.engine.async_engine import AsyncEngine, EngineDrainingError, QueueFullError
from deepbatch.core.errors import EngineDeadError, InvalidRequestError
from deepbatch.core.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def params(max_tokens=3, n=1):
    return SamplingParams(max_tokens=max_tokens, n=n)


def test_generate_streams_cumulative_outputs_from_the_engine_thread():
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()

    async def main():
        return [out async for out in engine.generate("hi", params(4), "r1")]

    outs = run(main())
    engine.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [7, 7, 7, 7]
    assert all(not o.finished for o in outs[:-1])
    assert fake.callers == {"deepbatch-engine"}  # LLMEngine is only ever touched by its thread
    assert engine.num_in_flight == 0 and engine.snapshot().num_steps == 4


def test_invalid_request_raises_before_queueing():
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()

    async def main():
        with pytest.raises(InvalidRequestError) as e:
            await engine.add_request("r1", "", params())
        assert e.value.param == "prompt"

    run(main())
    engine.shutdown()
    assert fake.callers == set() and engine.num_in_flight == 0


def test_waiting_queue_bound_raises_queue_full():
    fake = FakeEngine()
    fake.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)
    engine = AsyncEngine(fake, max_queued_requests=2)  # not started: everything stays queued

    async def main():
        await engine.add_request("a", "hi", params())
        await engine.add_request("b", "hi", params())
        with pytest.raises(QueueFullError):
            await engine.add_request("c", "hi", params())
        with pytest.raises(QueueFullError):  # n counts sequences
            await engine.add_request("d", "hi", params(n=2))
        assert engine.snapshot().num_waiting == 2

    run(main())
    engine.shutdown()


def test_waiting_token_bound_raises_queue_full():
    fake = FakeEngine()
    engine = AsyncEngine(fake, max_queued_tokens=10)  # not started: everything stays queued

    async def main():
        await engine.add_request("a", "hello", params())  # 5 tokens
        await engine.add_request("b", "abcd", params())  # 9
        with pytest.raises(QueueFullError, match="prompt tokens"):
            await engine.add_request("c", "xy", params())  # 11 > 10
        await engine.add_request("d", "x", params())  # exactly 10 fits
        with pytest.raises(QueueFullError):  # n multiplies the tokens
            await engine.add_request("e", "x", params(n=2))

    run(main())
    engine.shutdown()


def test_leaving_early_aborts_the_request():
    fake = FakeEngine(step_delay=0.01)
    engine = AsyncEngine(fake)
    engine.start()

    async def main():
        async for _ in engine.generate("hi", params(1000), "long"):
            break
        for _ in range(200):
            if not fake.requests and engine.num_in_flight == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the request was not aborted")

    run(main())
    engine.shutdown()


def test_cancelled_consumer_aborts_and_gets_abort_output():
    fake = FakeEngine(step_delay=0.01)
    engine = AsyncEngine(fake)
    engine.start()

    async def main():
        stream = await engine.add_request("r", "hi", params(1000))
        engine.abort("r")
        final = await stream.result()
        assert final.finished and final.outputs[0].finish_reason == "abort"

    run(main())
    engine.shutdown()
    assert not fake.requests


def test_step_failure_kills_the_engine():
    fake = FakeEngine(fail_at=3, step_delay=0.01)
    engine = AsyncEngine(fake)
    dead = []
    engine.add_dead_callback(dead.append)
    engine.start()

    async def main():
        # In one call: added one by one, a slow add could find the engine already dead.
        streams = await engine.add_requests([(f"r{i}", "hi") for i in range(3)], params(100))
        for s in streams:
            with pytest.raises(EngineDeadError):
                await s.result()
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hi", params())

    run(main())
    assert engine.is_dead and "boom" in str(engine.dead_error) and len(dead) == 1
    assert engine.num_in_flight == 0
    engine.shutdown()


def test_fault_injection_step():
    engine = AsyncEngine(FakeEngine(), fault_inject_step=2)
    engine.start()

    async def main():
        with pytest.raises(EngineDeadError, match="injected fault at engine step 2"):
            await (await engine.add_request("r", "hi", params(10))).result()

    run(main())
    engine.shutdown()


def test_drain_waits_then_aborts_and_refuses_new_requests():
    fake = FakeEngine(step_delay=0.01)
    engine = AsyncEngine(fake)
    engine.start()

    async def main():
        short = await engine.add_request("short", "hi", params(3))
        long = await engine.add_request("long", "hi", params(10_000))
        aborted = await engine.drain(timeout=0.3)
        assert aborted == 1
        assert (await short.result()).outputs[0].finish_reason == "length"
        assert (await long.result()).outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDrainingError):
            await engine.add_request("new", "hi", params())

    run(main())
    engine.shutdown()


def test_idle_engine_does_not_spin():
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()

    async def main():
        await (await engine.add_request("r", "hi", params(2))).result()
        steps = fake.stats.num_steps
        await asyncio.sleep(0.3)
        assert fake.stats.num_steps == steps

    run(main())
    engine.shutdown()
