"""Async scheduling under tensor parallelism (TP=2 over gloo): rank 0 schedules and launches step
N+1 before step N's sampled ids reach its host, every rank reads the pending input token from
its token pool, filled from the sampled ids rank 0 broadcasts, and the step messages count the
token pending until its id is committed. Token-identical to synchronous steps of the same engine,
for greedy and for seeded sampling with penalties, through chunked prefill and preemption; greedy
also equals HF."""

from __future__ import annotations

import pytest

from deepbatch import LLM, SamplingParams
from test_hf_parity import MAX_TOKENS, hf_greedy, make_prompts

PROMPTS = make_prompts(6)

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def penalised(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True,
                          repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.2)


def run(llm: LLM, async_scheduling: bool) -> tuple[list[list[int]], list[list[int]]]:
    llm.engine.async_scheduling = async_scheduling
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    sampled = [o.outputs[0].token_ids
               for o in llm.generate(prompts, [penalised(100 + i) for i in range(len(prompts))], use_tqdm=False)]
    return greedy, sampled


@pytest.mark.parametrize("arch, kwargs", [
    ("llama", dict(max_num_batched_tokens=32)),  # chunked prefill beside decodes
    ("qwen3", dict(num_gpu_blocks_override=8, max_num_seqs=6)),  # preemption with tokens in flight
])
def test_tp2_async_scheduling_is_token_identical_to_synchronous(tp_checkpoints, arch, kwargs):
    path = tp_checkpoints[arch]
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30,
              async_scheduling=True, **kwargs)
    try:
        engine = llm.engine
        steps = engine.stats.num_steps
        pipelined = run(llm, async_scheduling=True)
        assert engine.stats.num_steps > steps and engine._inflight is None
        synchronous = run(llm, async_scheduling=False)
        assert pipelined == synchronous
        assert pipelined[0] == hf_greedy(path, PROMPTS)
        if arch == "qwen3":
            assert engine.scheduler.num_preemptions > 0
        assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
        assert engine.runner._builder._known == {}
    finally:
        llm.engine.shutdown()
