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


def test_tp2_mtp_drafts_are_the_single_process_ones_and_keep_the_tokens(tmp_path):
    # DeepSeek-V3's MTP layer sharded with the model: each rank runs its shard of every draft
    # forward, rank 0 draws. Greedy and seeded output equal to TP=2 without drafts; the drafts
    # equal the single-process MTP's at the same tokens (tests/engine/test_spec_mtp.py holds those
    # to transformers' layer). 24-token steps split the prompts and a small pool preempts.
    import sys
    from pathlib import Path

    from deepbatch import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_deepseek import build_v3_mtp_checkpoint

    path, _, _ = build_v3_mtp_checkpoint(str(tmp_path))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "cost_model": False}
    common = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=24,
                  num_gpu_blocks_override=12)
    prompts = [{"prompt_token_ids": p[:40]} for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)]

    def generate(llm):
        seen = {}
        propose = llm.engine.proposer.propose if llm.engine.proposer is not None else None

        def recording(running, spec_cost=None):
            propose(running, spec_cost)
            seen.update({(r.request_id, tuple(r.all_token_ids)): list(r.spec_token_ids)
                         for r in running if r.spec_token_ids})

        if propose is not None:
            llm.engine.proposer.propose = recording
        try:
            outs = llm.generate(prompts, params * 3, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        return [o.outputs[0].token_ids for o in outs], seen

    want, _ = generate(LLM(path, tensor_parallel_size=2, distributed_timeout_s=30, **common))
    tp2 = LLM(path, tensor_parallel_size=2, distributed_timeout_s=30, speculative_config=spec, **common)
    preemptions = lambda: tp2.engine.scheduler.num_preemptions  # noqa: E731 - read before shutdown
    got, seen = generate(tp2)
    assert got == want
    # The single-process run last: a forked worker must not inherit the state its matmuls leave.
    _, single = generate(LLM(path, speculative_config=spec, **common))
    shared = set(seen) & set(single)
    assert len(shared) > 20 and all(seen[k] == single[k] for k in shared)
    assert preemptions() > 0
