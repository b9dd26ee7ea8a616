"""The draft model's drafts (``spec_decode/draft_model.py``) against HF transformers running the
draft checkpoint over each request's whole sequence, without a cache: what the draft cache keeps
between steps (its tokens, the drafts the target kept, a catch-up split over steps) must give the
same continuation as recomputing everything, greedy or drawn as the target draws
(``draw_drafts``)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from deepbatch import LLM, SamplingParams
from deepbatch.core.draft_row import DraftRow
from deepbatch.sampling.sampler import Sampler


def test_drafts_are_the_draft_checkpoints_continuation(tiny_checkpoints, monkeypatch):
    # A Qwen2 draft of other random weights for a Llama target: most drafts are rejected, so the
    # cache must drop their KV; 24-token steps split the longer catch-ups; and one step in three
    # runs without drafts (asynchronous), so a request may come back several tokens on.
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=256,
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
        # What a draw reads of the request, as it was when it drafted.
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids),
                     SimpleNamespace(sampling_params=r.sampling_params, num_output_tokens=r.num_output_tokens,
                                     index=r.index, request_id=r.request_id, parent_id=r.parent_id,
                                     structured_output=None))
                    for r in running if r.spec_token_ids)

    proposer.propose = recording
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (10, 30, 55, 70, 20, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.5, seed=4, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=40, ignore_eos=True)]  # engine-seeded
    llm.generate(prompts, params * 2, use_tqdm=False)
    stats = llm.engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert len(seen) > 60 and {s.sampling_params.seed is None for _, _, s in seen} == {True, False}

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"], dtype=torch.float32).eval()
    vocab = proposer.runner.draft_vocab
    sampler = Sampler(vocab, "cpu", fused=False)
    for tokens, drafts, request in seen:
        ids = list(tokens)
        with torch.no_grad():
            for j in range(len(drafts)):  # over the whole sequence, no cache, EOS not special
                logits = hf(torch.tensor([ids])).logits[0, -1, :vocab]
                if request.sampling_params.greedy:
                    ids.append(int(logits.argmax()))
                else:  # the draw the target makes in draft j's place
                    row = DraftRow(request, j, ids[len(tokens):])
                    ids.append(sampler.sample(logits[None].float(), [row]).resolve().token_ids[0])
        assert ids[len(tokens):] == drafts, (len(tokens), request.sampling_params)
