"""Sampled-token logprobs kept as step tables: each position reads as vLLM's dict, built once."""

import pickle

import torch

from deepbatch.core.logprobs import SampleLogprobs
from deepbatch.core.outputs import Logprob
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.sampling.pending_sample import _step_logprobs

K = 3


def step_table(rows: list[tuple[float, int, list[float], list[int]]]) -> torch.Tensor:
    """The sampler's host table: [sampled logprob, rank, K top logprobs, K top ids] per row."""
    return torch.tensor([[lp, rank, *tops, *ids] for lp, rank, tops, ids in rows], dtype=torch.float32)


def test_rows_read_as_vllms_dicts_sampled_token_first_without_repeating_it():
    table = step_table([(-0.5, 1, [-0.5, -1.5, -2.5], [7, 3, 9]),    # sampled = the best
                        (-2.5, 3, [-0.25, -1.5, -2.5], [4, 5, 8]),   # sampled = the third
                        (-4.0, 9, [-0.5, -1.0, -2.0], [1, 2, 6])])   # sampled outside the top
    params = [SamplingParams(logprobs=3), SamplingParams(logprobs=1), SamplingParams(logprobs=None)]
    step = _step_logprobs(table, K, [7, 8, 11], params)
    assert step[0] == {7: Logprob(-0.5, 1), 3: Logprob(-1.5, 2), 9: Logprob(-2.5, 3)}
    assert list(step[0]) == [7, 3, 9]
    assert step[1] == {8: Logprob(-2.5, 3), 4: Logprob(-0.25, 1)}  # asked for 1: the sampled one and the best
    assert list(step[1]) == [8, 4]
    assert step[2] is None
    assert step.wire(1) == {8: (-2.5, 3), 4: (-0.25, 1)}
    assert all(type(t) is int for t in step[0])


def test_a_sample_reads_like_a_list_and_builds_each_position_once():
    steps = [_step_logprobs(step_table([(-float(i), i + 1, [-0.5, -1.0, -2.0], [10 + i, 20, 30])]), K, [5], [
        SamplingParams(logprobs=2)]) for i in range(4)]
    sample = SampleLogprobs()
    for step in steps:
        sample.append_row(step, 0)
    want = [step[0] for step in steps]
    assert len(sample) == 4 and sample == want and list(sample) == want
    assert sample[1:3] == want[1:3] and sample[-1] == want[-1]
    assert sample[2] is sample[2]  # built once, then kept
    assert sample.wire(2) == [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in want[2:]]
    assert sample != want[:3] and sample != "not a list"


def test_a_copy_is_a_snapshot_and_survives_pickling():
    table = step_table([(-1.0, 2, [-0.5, -1.0, -2.0], [1, 2, 3])])
    step = _step_logprobs(table, K, [2], [SamplingParams(logprobs=1)])
    sample = SampleLogprobs()
    sample.append_row(step, 0)
    snapshot = sample.copy()
    sample.append({9: Logprob(-3.0, 4)})
    assert len(snapshot) == 1 and len(sample) == 2
    assert pickle.loads(pickle.dumps(sample)) == list(sample)
