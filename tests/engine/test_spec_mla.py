"""Speculative decoding on MLA models (DeepSeek-V2/V3 shapes, tiny random weights): a verification
step scores the newest token and its drafts (k + 1 query positions per request) in the latent
cache, through the torch path and the Triton kernels (interpreted on the CPU). Greedy output
equal token for token to decoding without drafts, with a draft model (the checkpoint drafting
for itself: every draft accepted) and with prompt lookup, beside chunked prefill."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from deepbatch import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from test_deepseek import build_deepseek_checkpoint

    root = tmp_path_factory.mktemp("mla-spec")
    return {arch: build_deepseek_checkpoint(arch, str(root / arch)) for arch in ("v2", "v3")}


@pytest.mark.parametrize("arch, backend, method", [
    ("v2", "torch", "draft_model"),
    ("v3", "torch", "ngram"),
    ("v2", "triton", "draft_model"),
])
def test_drafts_on_the_latent_cache_give_the_tokens_of_decoding_without_them(checkpoints, arch, backend, method):
    path = checkpoints[arch]
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (6, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12 if backend == "triton" else 24, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", attention_backend=backend, max_model_len=128,
                  max_num_batched_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, params, use_tqdm=False)]
    spec = ({"method": "draft_model", "model": path} if method == "draft_model"
            else {"method": "ngram", "prompt_lookup_min": 1})
    llm = LLM(path, **common, speculative_config={**spec, "num_speculative_tokens": 3, "cost_model": False})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
