"""Speculative decoding under tensor parallelism (TP=2 over gloo): the step messages carry each
request's drafts (prompt lookup's, or a draft model's, which runs whole in rank 0's process),
every rank runs them, rank 0 verifies. Greedy output equal to TP=1 without
drafts and to HF, seeded sampling with penalties equal to TP=2 without drafts, through chunked
prefill and preemption; drafts are run and accepted (tiny random models repeat themselves, so
prompt lookup finds their loops)."""

from __future__ import annotations

import pytest

from deepbatch import LLM
from test_hf_parity import hf_greedy
from test_tensor_parallel_async import PROMPTS, run

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "cost_model": False}


@pytest.mark.parametrize("arch, method, kwargs", [
    ("llama", "ngram", dict(max_num_batched_tokens=32)),  # chunked prefill beside verification
    ("qwen3", "ngram", dict(num_gpu_blocks_override=8, max_num_seqs=6)),  # preemption drops drafts
    # The checkpoint drafting for itself, whole in rank 0's process, its catch-up split by 32-token steps.
    ("llama", "draft_model", dict(max_num_batched_tokens=32)),
])
def test_tp2_drafts_give_the_tokens_of_decoding_without_them(tp_checkpoints, arch, method, kwargs):
    path = tp_checkpoints[arch]
    spec = SPEC if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                           "cost_model": False}
    common = dict(dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30, **kwargs)
    plain = LLM(path, **common)
    try:
        want = run(plain, async_scheduling=False)  # greedy, then seeded sampling with penalties
    finally:
        plain.engine.shutdown()
    llm = LLM(path, speculative_config=spec, **common)
    try:
        got = run(llm, async_scheduling=False)
        engine = llm.engine
        assert engine.stats.spec_num_accepted_tokens > 0
        assert got == want
        assert got[0] == hf_greedy(path, PROMPTS)
        if arch == "qwen3":
            assert engine.scheduler.num_preemptions > 0
        if method == "draft_model":  # unsharded: all of the checkpoint's heads, no collectives
            assert engine.proposer.runner.attn_layers[0].num_heads == 4
        assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
    finally:
        llm.engine.shutdown()
