"""Prefix-cache hits of requests that ask for prompt logprobs: a hit has no logits, so such a
request takes none for a prompt position whose logprob it has not recorded yet (all of them at
first, none once recorded: a rerun after preemption may hit), while its own blocks are still
published for others; the other samples of the same prompt (n > 1) hit as usual."""

from __future__ import annotations

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.kv_cache.manager import KVCacheManager

BS = 4
PREFIX = list(range(100, 112))  # three full blocks


def run_prompt(kv: KVCacheManager, r: Request) -> int:
    """Admit ``r`` and compute its whole prompt; returns the tokens it took from the cache."""
    hits, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_prompt_tokens - n_hit, hits) is not None
    r.num_computed_tokens = r.num_prompt_tokens
    return n_hit


def request(rid: str, tokens, prompt_logprobs=None, index=0) -> Request:
    return Request(rid, list(tokens), SamplingParams(prompt_logprobs=prompt_logprobs), 4, index=index)


def record(r: Request, num_positions: int) -> None:
    r.record_prompt_logprobs(0, [(-1.0, 1, {}) for _ in range(num_positions)])


def test_no_hits_for_positions_still_to_record_and_own_blocks_are_published():
    kv = KVCacheManager(32, BS)
    assert run_prompt(kv, request("warm", PREFIX + [1, 2])) == 0
    asking = request("asking", PREFIX + [3, 4], prompt_logprobs=2)
    assert kv.get_computed_blocks(asking) == ([], 0)
    # Without prompt logprobs the same prompt hits the three cached blocks.
    assert kv.get_computed_blocks(request("plain", PREFIX + [3, 4]))[1] == 12
    # Its own blocks go to the cache for others: a later prompt sharing them hits all four.
    own = PREFIX + [3, 4, 5, 6]
    assert run_prompt(kv, request("asking-own", own + [7], prompt_logprobs=0)) == 0
    assert run_prompt(kv, request("later", own + [8])) == 16


def test_hits_reach_as_far_as_the_recorded_positions():
    kv = KVCacheManager(32, BS)
    prompt = PREFIX + [1, 2, 3, 4, 5]  # 17 tokens: four full blocks before the last token
    run_prompt(kv, request("warm", prompt))
    rerun = request("rerun", prompt, prompt_logprobs=1)
    record(rerun, 6)  # positions 0..5: a hit may end at token 6, inside block 1
    assert kv.get_computed_blocks(rerun)[1] == 4
    record(rerun, 8)  # positions 0..7: two whole blocks
    assert kv.get_computed_blocks(rerun)[1] == 8
    record(rerun, 16)  # every position: the whole prompt but its last token, as for anyone
    assert kv.get_computed_blocks(rerun)[1] == 16


def test_other_samples_of_the_prompt_hit():
    kv = KVCacheManager(32, BS)
    run_prompt(kv, request("warm", PREFIX + [1]))
    first = request("p-0", PREFIX + [9], prompt_logprobs=3, index=0)
    second = request("p-1", PREFIX + [9], prompt_logprobs=3, index=1)
    assert first.prompt_logprobs == [None] and second.prompt_logprobs is None
    assert kv.get_computed_blocks(first)[1] == 0
    assert kv.get_computed_blocks(second)[1] == 12
