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

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))


class EagerReplay(_GraphSet):
    """A graph set whose replay is a forward over the static buffers."""

    replays: list[tuple[bool, int, int]]  # (mixed, size, real tokens)

    def replay(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.batch(size))

    def run(self, batch, size):
        self.replays.append((self.mixed, size, batch.num_tokens))
        return super().run(batch, size)


def _eager_replay_graphs(runner, max_num_seqs: int, max_num_batched_tokens: int) -> CudaGraphs:
    graphs = CudaGraphs(runner.model, max_num_seqs, runner.max_blocks_per_seq, runner.max_model_len, runner.device,
                        max_num_batched_tokens=max_num_batched_tokens)
    replays = []
    for gs in (graphs.decode, graphs.mixed):
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
    mixed = [r for r in replays if r[0]]
    # Mixed steps went through graphs, padded (to 16, 32 or 40 tokens) with real tokens fewer.
    assert mixed and any(size > real for _, size, real in mixed)
    assert {size for _, size, _ in mixed} <= {16, 32, 40}
    assert any(not m for m, _, _ in replays)  # and decode steps through decode graphs
