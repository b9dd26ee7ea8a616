"""Preemption by swap under tensor parallelism (TP=2 over gloo): every rank keeps its own host
pool for its heads' share of each block, the step messages carry the swap copies (a step may be
only swap-outs), and the swap cost model's prefill rate is measured with a forward every rank
runs. Greedy output equals HF transformers on the same weights, synchronous and async."""

from __future__ import annotations

import pytest

from deepbatch import LLM, SamplingParams
from deepbatch.scheduler.preemption import RECOMPUTE, SWAP
from test_hf_parity import hf_greedy, make_prompts

PROMPTS = make_prompts(6)
MAX_TOKENS = 24


@pytest.mark.parametrize("arch, async_scheduling", [("llama", False), ("deepseek_v2", True)])
def test_tp2_swap_preemption_matches_hf(tp_checkpoints, arch, async_scheduling):
    path = tp_checkpoints[arch]
    # 32 blocks of 4 tokens hold the longest request (64 + 24 tokens) but not all six at once. The prefill
    # rate is left to the start-up measurement, which every rank joins.
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30,
              block_size=4, num_gpu_blocks_override=32, max_num_seqs=6, swap_space=1 / 1024,
              preemption_mode="swap", swap_host_link_bytes_per_s=1e15, async_scheduling=async_scheduling)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        modes = engine.scheduler.preemptor.num_preemptions_by_mode
        assert modes[SWAP] > 0 and modes[RECOMPUTE] == 0
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, MAX_TOKENS)
        assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
        assert engine.scheduler.preemptor.num_swapped == 0  # every swapped request came back
    finally:
        llm.engine.shutdown()
