"""Sampling end to end: seeds reproduce, n > 1, logprobs, min/max tokens, penalties, abort."""

from __future__ import annotations

import math

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.sampling.sampler import _top_k_top_p

PROMPT = {"prompt_token_ids": [11, 12, 13, 14, 15, 16]}


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["qwen2"], dtype="float32", device="cpu", max_model_len=256)


def test_seed_reproducible_and_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": [20, 21]}, PROMPT, PROMPT], [others, p, others], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


@pytest.mark.parametrize("cuts", [{}, dict(top_p=0.9, top_k=20, min_p=0.02)], ids=["temperature", "top-k-p-min-p"])
def test_seeded_request_is_the_same_alone_and_in_batches_of_7_and_64(llm, cuts):
    p = SamplingParams(temperature=0.9, seed=77, max_tokens=8, ignore_eos=True, **cuts)
    alone = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    for size in (7, 64):
        prompts = [{"prompt_token_ids": [20 + i % 40, 21, 22 + i % 3]} for i in range(size)]
        params = [SamplingParams(temperature=0.5 + (i % 4) * 0.3, top_p=1.0 if i % 2 else 0.8, max_tokens=4 + i % 9,
                                 ignore_eos=True, seed=None if i % 3 else 1000 + i) for i in range(size)]
        at = size // 2
        prompts[at], params[at] = PROMPT, p
        assert llm.generate(prompts, params, use_tqdm=False)[at].outputs[0].token_ids == alone, size


def test_top_k_1_and_a_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    for cut in (dict(top_k=1), dict(top_p=1e-6)):
        p = SamplingParams(temperature=1.3, max_tokens=8, ignore_eos=True, **cut)
        assert llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids == greedy, cut


def test_n_samples(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_logprobs_in_vllms_shape(llm):
    """One {token_id: Logprob} per token: the sampled token first with its rank, then the top 3
    ranked 1..3; greedy tokens rank 1; the cumulative logprob sums the sampled tokens'."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == tok and entry[tok].rank == 1 and len(entry) == 3
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert max(entry, key=lambda t: entry[t].logprob) == tok and entry[tok].logprob <= 0
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprobs_and_ranks_match_hf_transformers(llm, tiny_checkpoints):
    """Each generated position against HF transformers on the same weights: the sampled token's
    logprob and rank, and the top 3, from the log-softmax of HF's next-token logits."""
    from transformers import AutoModelForCausalLM

    out = llm.generate([PROMPT], SamplingParams(temperature=1.5, seed=3, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"], dtype=torch.float32).eval()
    ids = PROMPT["prompt_token_ids"] + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    n = len(PROMPT["prompt_token_ids"])
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = torch.log_softmax(logits[n - 1 + j], dim=-1)
        assert entry[tok].logprob == pytest.approx(ref[tok].item(), abs=1e-4)
        assert entry[tok].rank == int((ref > ref[tok]).sum()) + 1
        top = ref.topk(3)
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4) and (t == tok or entry[t].rank == rank)


def test_sampled_token_rank_counts_the_more_likely_tokens(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=1.5, seed=3, max_tokens=24, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    ranks = []
    for tok, entry in zip(out.token_ids, out.logprobs):
        mine = entry[tok]
        assert next(iter(entry)) == tok and len(entry) == (3 if mine.rank <= 3 else 4)
        above = sum(lp.logprob > mine.logprob for t, lp in entry.items() if t != tok)
        assert above == min(mine.rank - 1, 3), (tok, entry)
        ranks.append(mine.rank)
    assert max(ranks) > 1  # at T = 1.5 some draws are not the top token


def test_min_tokens_bans_eos(llm):
    eos = 2
    bias = {eos: 100.0}  # make EOS overwhelmingly likely
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, logit_bias=bias),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:5]


def test_stop_token_ids(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                stop_token_ids=[greedy[2]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(greedy[2]) + 1]
    assert out.stop_reason == greedy[2]


def test_repetition_penalty_changes_greedy_choice(llm):
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    pen = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                frequency_penalty=2.0, presence_penalty=2.0),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(pen)) >= len(set(plain))
    assert pen != plain or len(set(plain)) == len(plain)


def test_top_k_top_p_mask():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = _top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    # Row 2: p(4.0) = 0.64 >= 0.5, so only the top token survives.
    assert torch.isfinite(out[1, 0]) and torch.isinf(out[1, 1:]).all()


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", [5] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache.pool.num_free_blocks < engine.num_blocks
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()
