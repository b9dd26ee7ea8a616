"""The draft model's forwards through its decode CUDA graphs' padded static inputs give the
drafts of the eager forwards: every draft of a model drafting for itself is accepted, and the
output is the eager run's. On the CPU the replay is a forward over the static buffers
(``EagerReplay``, as for the target's graphs); capture itself runs on the GPU."""

from __future__ import annotations

import random

import pytest

from deepbatch import LLM, SamplingParams
from deepbatch.runner.cuda_graph import CudaGraphs

pytest.importorskip("triton")


def test_drafts_through_decode_graph_padding_are_the_targets_tokens(tiny_checkpoints):
    from test_cuda_graph import EagerReplay

    path = tiny_checkpoints["qwen3"]
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 19, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", attention_backend="triton", max_num_seqs=4, max_model_len=128)
    want = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, params, use_tqdm=False)]

    llm = LLM(path, **common, speculative_config={"method": "draft_model", "model": path,
                                                  "num_speculative_tokens": 3, "cost_model": False})
    draft = llm.engine.proposer.runner
    graphs = CudaGraphs(draft.model, 4, -(-draft.max_model_len // draft.block_size), draft.max_model_len,
                        draft.device)
    graphs.decode.__class__ = EagerReplay
    graphs.decode.replays = []
    graphs.decode.graphs = dict.fromkeys(graphs.decode.sizes)  # "captured"
    draft.graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    replays = graphs.decode.replays
    # Three requests padded to the size-4 graph, and one alone once the others finished or before.
    assert any(size > real for _, size, real in replays) and len(replays) >= 4
