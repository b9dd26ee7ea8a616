"""The Triton attention backend drives the whole model to the same greedy tokens as the torch
backend (through the Triton interpreter on the CPU; compiled on a GPU)."""

from __future__ import annotations

import random

import pytest

from deepbatch import LLM, SamplingParams

pytest.importorskip("triton")


def test_triton_backend_matches_torch_backend(tiny_checkpoints):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 20, 33, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        # A 32-token budget mixes chunked prefills with decodes in the same launches.
        llm = LLM(tiny_checkpoints["qwen3"], dtype="float32", device="cpu", attention_backend=backend,
                  max_num_batched_tokens=32)
        assert llm.engine.runner.backend.name == backend
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got["triton"] == got["torch"]
