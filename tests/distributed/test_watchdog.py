"""A tensor-parallel rank that dies, stalls or fails makes the engine dead within the timeout,
never hung: the step in progress raises EngineDeadError, in-flight requests of the async engine
end with it, later requests are refused with it, and the remaining workers are ended. A worker
that dies while the engine is idle is noticed too."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from deepbatch import LLM, EngineDeadError, SamplingParams
from deepbatch.engine.async_engine import AsyncEngine
from test_hf_parity import make_prompts

TIMEOUT_S = 4.0
# Spawning a worker and loading a model on a busy two-core machine, plus the timeout itself.
SLACK_S = 20.0
# How late past the moment it is due a busy machine may report the death.
LATE_S = 4.0
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def tp2_engine(path: str):
    return LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S).engine


def within(seconds: float, fn):
    """``fn()``'s result, failing the test (instead of hanging it) if it takes longer."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s: the engine hung")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def assert_workers_ended(engine) -> None:
    for proc in engine.runner._procs:
        proc.join(5.0)
        assert not proc.is_alive()


def test_worker_killed_mid_run(tp_checkpoints):
    engine = tp2_engine(tp_checkpoints["llama"])
    try:
        for p in make_prompts(4):
            engine.add_request(None, {"prompt_token_ids": p}, LONG)
        for _ in range(3):
            engine.step()
        os.kill(engine.runner._procs[0].pid, signal.SIGKILL)
        start = time.monotonic()

        def step_until_dead():
            with pytest.raises(EngineDeadError):
                while engine.has_unfinished_requests():
                    engine.step()

        within(TIMEOUT_S + SLACK_S, step_until_dead)
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT_S + LATE_S, f"dead after {elapsed:.1f} s"
        with pytest.raises(EngineDeadError):  # and every later step fails at once
            engine.step()
        assert_workers_ended(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["stall", "raise"])
def test_faulty_worker_fails_in_flight_requests(tp_checkpoints, monkeypatch, mode):
    monkeypatch.setenv("DEEPBATCH_FAULT_INJECT_WORKER_STEP", "4")
    monkeypatch.setenv("DEEPBATCH_FAULT_INJECT_WORKER_MODE", mode)
    engine = tp2_engine(tp_checkpoints["qwen3"])
    dead_calls = []

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.add_dead_callback(dead_calls.append)
        async_engine.start()
        outputs = 0
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in async_engine.generate({"prompt_token_ids": make_prompts(1)[0]}, LONG):
                outputs += 1
                start = time.monotonic()  # the fault comes after the last output
        elapsed = time.monotonic() - start
        assert 0 < outputs < LONG.max_tokens
        assert async_engine.is_dead
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("later", {"prompt_token_ids": [5, 6, 7]}, LONG)
        async_engine.shutdown()
        return elapsed

    try:
        elapsed = within(TIMEOUT_S + SLACK_S, lambda: asyncio.run(main()))
        if mode == "stall":  # a stall is found by a collective's timeout
            assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + LATE_S, f"dead after {elapsed:.1f} s"
        else:  # an error ends the worker, which closes its connections at once
            assert elapsed < TIMEOUT_S, f"dead after {elapsed:.1f} s"
        assert len(dead_calls) == 1
        assert_workers_ended(engine)
    finally:
        engine.shutdown()


def test_worker_dying_while_idle_turns_the_engine_dead(tp_checkpoints):
    engine = tp2_engine(tp_checkpoints["deepseek_v2"])

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        out = [o async for o in async_engine.generate({"prompt_token_ids": [5, 6, 7]},
                                                      SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))]
        assert out[-1].finished and not async_engine.is_dead
        os.kill(engine.runner._procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        while not async_engine.is_dead:  # no request in flight: only the watchdog can notice
            assert time.monotonic() - start < LATE_S, "a dead worker went unnoticed"
            await asyncio.sleep(0.05)
        assert "rank 1" in str(async_engine.dead_error)
        async_engine.shutdown()

    try:
        within(SLACK_S, lambda: asyncio.run(main()))
    finally:
        engine.shutdown()
