"""CUDA-graph steps: every step, decode or mixed, run through the graphs' padded static inputs
gives the tokens of the eager run.

A graph replays what was captured on the static buffers, so on the CPU the replay is stood in
for by a forward over those same buffers (``EagerReplay``): what is tested is the padding
(tokens past the step that belong to no sequence, sequence slots with ``q_len 0``, stale block
tables and positions left by larger steps) through the Triton kernels under the interpreter.
Capture itself runs on the GPU (``benchmarks/gpu_parity.py``)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.runner.cuda_graph import CudaGraphs, _GraphSet, capture_sizes, mixed_capture_sizes
from deepbatch.spec_decode.room import draft_room

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


class EagerReplay(_GraphSet):
    """A graph set whose replay is a forward over the static buffers."""

    replays: list[tuple[str, int, int]]  # (decode | mixed | verify, size, real tokens)

    def replay(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.batch(size))

    def run(self, batch, size):
        kind = "verify" if self.query_len else "mixed" if self.mixed else "decode"
        self.replays.append((kind, size, batch.num_tokens))
        return super().run(batch, size)


def _eager_replay_graphs(runner, max_num_seqs: int, max_num_batched_tokens: int,
                         verify_query_len: int | None = None) -> CudaGraphs:
    graphs = CudaGraphs(runner.model, max_num_seqs, runner.max_blocks_per_seq, runner.max_model_len, runner.device,
                        max_num_batched_tokens=max_num_batched_tokens, verify_query_len=verify_query_len)
    replays = []
    for gs in (g for g in (graphs.decode, graphs.mixed, graphs.verify) if g is not None):
        gs.__class__ = EagerReplay
        gs.replays = replays
        gs.graphs = dict.fromkeys(gs.sizes)  # "captured"
    return graphs


def test_capture_sizes():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert mixed_capture_sizes(8192)[:6] == [16, 32, 64, 128, 256, 512] and mixed_capture_sizes(8192)[-1] == 8192
    assert mixed_capture_sizes(1000)[-2:] == [768, 1000]
    assert mixed_capture_sizes(48) == [16, 32, 48]


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2", "deepseek_v2-expanded"])
def test_graph_padding_matches_eager(arch, tiny_checkpoints, tmp_path):
    mode = {"mla_prefill": "expanded"} if arch.endswith("-expanded") else {}
    if arch.startswith("deepseek_v2"):
        from test_deepseek import build_deepseek_checkpoint

        path = build_deepseek_checkpoint("v2", str(tmp_path / "v2"))
    else:
        path = tiny_checkpoints[arch]
    rng = random.Random(0)
    # Lengths that cross the 16/32-token graph sizes; a 40-token budget mixes chunks with decodes
    # and leaves most steps padded.
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 23, 37, 50, 9, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", attention_backend="triton", max_num_seqs=4,
                  max_num_batched_tokens=40, enable_prefix_caching=True, **mode)
    eager = LLM(path, **common)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager

    llm = LLM(path, **common)
    runner = llm.engine.runner
    runner.graphs = _eager_replay_graphs(runner, 4, 40)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    replays = runner.graphs.decode.replays
    mixed = [r for r in replays if r[0] == "mixed"]
    # Mixed steps went through graphs, padded (to 16, 32 or 40 tokens) with real tokens fewer.
    assert mixed and any(size > real for _, size, real in mixed)
    assert {size for _, size, _ in mixed} <= {16, 32, 40}
    assert any(m == "decode" for m, _, _ in replays)  # and decode steps through decode graphs


class RepeatProposer:
    """Drafts the request's own last ``k`` tokens again (right or wrong, the output must not move)."""

    def __init__(self, k: int, max_model_len: int):
        self.k, self.max_model_len = k, max_model_len

    def propose(self, running, spec_cost=None):
        for r in running:
            r.spec_token_ids = list(r.all_token_ids[-self.k:])[:draft_room(r, self.k, self.max_model_len)]

    def forget(self, request_id):
        pass


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2"])
def test_verification_graphs_match_eager(arch, tiny_checkpoints, tmp_path):
    """Verification steps (k = 3) through graphs of B * 4 tokens and B seats: requests with fewer
    drafts than k, steps beside a prefill chunk (the mixed graphs), and batches below the graph's
    seats give the tokens of the eager run."""
    if arch == "deepseek_v2":
        from test_deepseek import build_deepseek_checkpoint

        path = build_deepseek_checkpoint("v2", str(tmp_path / "v2"))
    else:
        path = tiny_checkpoints[arch]
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 23, 9, 41, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", attention_backend="triton", max_num_seqs=4,
                  max_num_batched_tokens=24, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                 "cost_model": False})
    want = [o.outputs[0].token_ids for o in LLM(path, **{**common, "speculative_config": None}).generate(
        prompts, params, use_tqdm=False)]

    llm = LLM(path, **common)
    llm.engine.proposer = RepeatProposer(3, llm.engine.max_model_len)
    runner = llm.engine.runner
    runner.graphs = _eager_replay_graphs(runner, 4, 24, verify_query_len=4)
    assert runner.graphs.verify.sizes == [4, 8, 16]  # batches 1, 2, 4
    # No verification graph beyond the token budget (nor was the memory profiled for one).
    assert _eager_replay_graphs(runner, 4, 12, verify_query_len=4).verify.sizes == [4, 8]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    replays = runner.graphs.decode.replays
    verify = [(size, real) for kind, size, real in replays if kind == "verify"]
    assert verify and any(size > real for size, real in verify)  # padded: fewer drafts or seats
    assert any(kind == "mixed" for kind, _, _ in replays)  # prefill chunks still take the mixed graphs
    assert llm.engine.stats.spec_num_draft_tokens > 0
