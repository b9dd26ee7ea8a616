"""TP=2 over gloo (two processes) gives the same greedy tokens as TP=1 and as HF transformers
``generate`` on the same fp32 weights, for Llama (KV heads split), Qwen3 (one KV head, replicated)
and DeepSeek-V2 (MLA heads split, MoE experts split), through batched prefill of prompts of
varied length, chunked prefill beside decodes, prefix-cache hits and preemption."""

from __future__ import annotations

import multiprocessing

import pytest

from deepbatch import LLM, SamplingParams
from deepbatch.runner.model_runner import ModelRunner
from test_hf_parity import MAX_TOKENS, hf_greedy, make_prompts, shared_prefix_prompts

PROMPTS = make_prompts(6)  # 3 to 64 tokens

# Each model also takes a different scheduling path, so the step messages carry chunks,
# decodes beside prefills, and block tables rebuilt after preemption.
CASES = {
    "llama": dict(max_num_batched_tokens=32),
    "qwen3": dict(num_gpu_blocks_override=8, max_num_seqs=6),
    "deepseek_v2": dict(),
}


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy(path: str, tp: int, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=tp, distributed_timeout_s=30, **kwargs)
    return tokens(llm, PROMPTS), llm


@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_greedy_matches_tp1_and_hf(tp_checkpoints, arch):
    path = tp_checkpoints[arch]
    kwargs = CASES[arch]
    tp1, llm1 = greedy(path, 1, **kwargs)
    assert type(llm1.engine.runner) is ModelRunner and not multiprocessing.active_children()  # TP=1: one process
    tp2, llm = greedy(path, 2, **kwargs)
    try:
        assert tp2 == tp1
        assert tp2 == hf_greedy(path, PROMPTS)
        engine = llm.engine
        attn = engine.runner.model.model.layers[0].self_attn
        # Rank 0 holds half of the query heads; the KV heads it holds depend on the model.
        assert attn.num_heads == engine.hf_config.num_attention_heads // 2
        if arch == "qwen3":
            assert engine.hf_config.num_key_value_heads == 1 and attn.num_kv_heads == 1
            assert engine.scheduler.num_preemptions > 0
        if arch == "llama":
            assert attn.num_kv_heads == 1
            # Prefix-cache hits: the workers reuse the blocks rank 0's cache manager hands out.
            first, rest = shared_prefix_prompts()[:1], shared_prefix_prompts()[1:4]
            assert tokens(llm, first) + tokens(llm, rest) == tokens(llm1, first) + tokens(llm1, rest)
            assert engine.kv_cache.num_hit_tokens >= 48 * len(rest)
        assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
        assert engine.runner._builder._known == {}  # every finished request was dropped
    finally:
        llm.engine.shutdown()
    assert not any(p.is_alive() for p in llm.engine.runner._procs)


def test_tp2_expanded_mla_prefill_matches_hf(tp_checkpoints):
    """Each rank decompresses the latents into its own half of the heads (kv_b_proj is
    column-parallel); chunks over cached context beside decodes under a budget of 16."""
    path = tp_checkpoints["deepseek_v2"]
    tp2, llm = greedy(path, 2, mla_prefill="expanded", max_num_batched_tokens=16)
    try:
        assert tp2 == hf_greedy(path, PROMPTS)
        assert llm.engine.runner.model.model.layers[0].self_attn.prefill_mode == "expanded"
    finally:
        llm.engine.shutdown()


def test_flags_reach_the_frozen_config():
    from deepbatch.cli import build_parser, engine_config_from_args
    from deepbatch.config import ParallelConfig

    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2", "--distributed-timeout-s", "7"])
    assert engine_config_from_args(args).parallel == ParallelConfig(2, 7.0)
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).parallel == ParallelConfig(1, 60.0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        ParallelConfig(2, 0)
