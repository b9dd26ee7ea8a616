"""Speculative decoding under tensor parallelism (TP=2 over gloo): the step messages carry each
request's drafts, every rank runs them, rank 0 verifies. Greedy output equal to TP=1 without
drafts and to HF, seeded sampling with penalties equal to TP=2 without drafts, through chunked
prefill and preemption; drafts are run and accepted (tiny random models repeat themselves, so
prompt lookup finds their loops)."""

from __future__ import annotations

import pytest

from deepbatch import LLM
from test_hf_parity import hf_greedy
from test_tensor_parallel_async import PROMPTS, run

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "cost_model": False}


@pytest.mark.parametrize("arch, kwargs", [
    ("llama", dict(max_num_batched_tokens=32)),  # chunked prefill beside verification
    ("qwen3", dict(num_gpu_blocks_override=8, max_num_seqs=6)),  # preemption drops drafts
])
def test_tp2_drafts_give_the_tokens_of_decoding_without_them(tp_checkpoints, arch, kwargs):
    path = tp_checkpoints[arch]
    common = dict(dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30, **kwargs)
    plain = LLM(path, **common)
    try:
        want = run(plain, async_scheduling=False)  # greedy, then seeded sampling with penalties
    finally:
        plain.engine.shutdown()
    llm = LLM(path, speculative_config=SPEC, **common)
    try:
        got = run(llm, async_scheduling=False)
        engine = llm.engine
        assert engine.stats.spec_num_accepted_tokens > 0
        assert got == want
        assert got[0] == hf_greedy(path, PROMPTS)
        if arch == "qwen3":
            assert engine.scheduler.num_preemptions > 0
        assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
    finally:
        llm.engine.shutdown()
