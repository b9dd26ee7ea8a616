"""The engine feeds the SLO controller every step (wall time, shape, first tokens, finishes), with
and without async scheduling, and the controller's limits stay inside the configured ones;
outputs do not depend on it."""

from __future__ import annotations

import pytest

from deepbatch import LLM, SamplingParams

PROMPTS = [[3 + i, 7, 11 + i, 13] * (2 + i % 5) for i in range(24)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def expected(tiny_checkpoints):
    plain = LLM(tiny_checkpoints["llama"], **KWARGS)
    assert plain.engine.controller is None
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_feeds_the_controller_and_outputs_are_unchanged(tiny_checkpoints, expected, async_scheduling):
    controlled = LLM(tiny_checkpoints["llama"], slo_ttft_ms=1000.0, slo_tpot_ms=200.0,
                     async_scheduling=async_scheduling, **KWARGS)
    ctl = controlled.engine.controller
    got = [o.outputs[0].token_ids for o in controlled.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    assert ctl.num_steps == controlled.engine.stats.num_steps  # every launched step is committed once
    assert len(ctl.fit.steps) == ctl.num_steps and all(t > 0 for _, _, t in ctl.fit.steps)
    ttft, tpot = ctl.observed_p99()
    assert ttft is not None and ttft > 0 and tpot is not None and tpot > 0
    sched = controlled.engine.scheduler
    assert 1 <= sched.max_num_seqs <= 8 and 1 <= sched.max_num_batched_tokens <= 64
    assert controlled.engine._inflight is None  # no launch left without its commit
