"""Peers measured in the same process on the same weights: HF transformers ``generate`` with
static left-padded batches, and HF's own continuous batching (``generate_batch``)."""

from __future__ import annotations

import time

import torch

from deepbatch.bench.workloads import Workload


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def hf_static(model, workload: Workload, batch_size: int, device) -> dict:
    """Left-padded static batches in workload order; a batch runs until its longest output is
    done (EOS ignored). Only each request's own output tokens count as useful."""
    pad = 0
    _sync(device)
    t0 = time.perf_counter()
    for start in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[start : start + batch_size]
        outs = workload.output_lens[start : start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(outs)
        kwargs = dict(do_sample=workload.temperature > 0, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        if workload.temperature > 0:
            kwargs.update(temperature=workload.temperature, top_k=0, top_p=1.0)
        model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
    _sync(device)
    dt = time.perf_counter() - t0
    return {"name": f"hf-static(b={batch_size})", "seconds": dt, "requests": workload.num_requests,
            "output_tokens": workload.num_output_tokens, "prompt_tokens": workload.num_prompt_tokens}


@torch.no_grad()
def hf_continuous(model, workload: Workload, device) -> dict:
    """transformers' continuous batching (``generate_batch``, paged attention)."""
    from transformers import GenerationConfig

    n = max(workload.output_lens)
    gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    _sync(device)
    t0 = time.perf_counter()
    model.generate_batch(inputs=workload.prompts, generation_config=gen)
    _sync(device)
    dt = time.perf_counter() - t0
    # generate_batch cannot take per-request lengths, so every request generates the longest
    # output; count what it generated.
    return {"name": "hf-continuous", "seconds": dt, "requests": workload.num_requests,
            "output_tokens": n * workload.num_requests, "prompt_tokens": workload.num_prompt_tokens}
