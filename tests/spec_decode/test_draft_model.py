"""The draft model's drafts (``spec_decode/draft_model.py``) against HF transformers running the
draft checkpoint over each request's whole sequence, without a cache: what the draft cache keeps between steps
(its tokens, the drafts the target kept, a catch-up split over steps) must give the same greedy
continuation as recomputing everything."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from deepbatch import LLM, SamplingParams


def test_drafts_are_the_draft_checkpoints_greedy_continuation(tiny_checkpoints, monkeypatch):
    # The target drafting for itself: greedy requests keep every draft, requests sampled at a
    # high temperature reject many, so the cache must drop their KV; 24-token steps split the
    # longer catch-ups; and one step in three runs without drafts (asynchronous), so a request
    # may come back several tokens on.
    llm = LLM(tiny_checkpoints["qwen2"], dtype="float32", device="cpu", max_model_len=256,
              max_num_batched_tokens=24,
              speculative_config={"method": "draft_model", "model": tiny_checkpoints["qwen2"],
                                  "num_speculative_tokens": 3, "cost_model": False})
    proposer = llm.engine.proposer
    steps = iter(range(10**6))
    monkeypatch.setattr(llm.engine, "async_scheduling", True)
    monkeypatch.setattr(llm.engine, "_wants_drafts", lambda: next(steps) % 3 != 0)
    seen = []
    propose = proposer.propose

    def recording(running, spec_cost=None):
        propose(running, spec_cost)
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids)) for r in running if r.spec_token_ids)

    proposer.propose = recording
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (10, 30, 55, 70)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.5, seed=4, max_tokens=40, ignore_eos=True)]
    llm.generate(prompts, params * 2, use_tqdm=False)
    stats = llm.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert len(seen) > 40

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"], dtype=torch.float32).eval()
    for tokens, drafts in seen:
        ids = list(tokens)
        with torch.no_grad():
            for _ in drafts:  # greedy over the whole sequence, no cache, EOS not special
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(tokens):] == drafts, len(tokens)
