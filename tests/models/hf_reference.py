"""Greedy token ids from an HF transformers model: the reference the model tests hold the engine to."""

from __future__ import annotations

import torch


def hf_greedy_ids(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt generated alone (no padding in the reference), EOS ignored."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs
