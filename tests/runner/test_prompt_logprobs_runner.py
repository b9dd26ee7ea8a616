"""Prompt logprobs from the runner, held to HF transformers' log-softmax over the whole prompt:
the runner is driven with hand-built steps (no scheduler), so chunk boundaries, a one-token chunk,
a request that does not ask, a step that samples nothing and the prompt's last position are each
placed exactly. A step without such requests returns what it returned before (no prompt logprobs,
no PendingSample for a step that samples nothing)."""

from __future__ import annotations

import pytest
import torch

from deepbatch.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepbatch.models.loader import build_model, load_hf_config, resolve_model
from deepbatch.runner.model_runner import ModelRunner

BLOCK = 4
MAX_LEN = 128


@pytest.fixture(scope="module")
def runner(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    config = EngineConfig(model=ModelConfig(path, torch.float32, MAX_LEN),
                          cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), device="cpu")
    source = resolve_model(path)
    hf_config = load_hf_config(source)
    model = build_model(config.model, source, hf_config, "cpu", MAX_LEN)
    runner = ModelRunner(config, model, hf_config, MAX_LEN)
    runner.init_kv_cache(64)
    return runner


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]``: row ``p`` is the distribution of the token after position ``p``."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


class Blocks:
    """Hands out disjoint block ids, enough for each request's whole prompt."""

    def __init__(self):
        self.next = 0

    def give(self, r: Request) -> Request:
        n = -(-(r.num_prompt_tokens + 1) // BLOCK)
        r.block_ids = list(range(self.next, self.next + n))
        self.next += n
        return r


def run_chunks(runner, steps: list[list[tuple[Request, int]]]):
    """Each step schedules ``(request, num_new_tokens)`` pairs; counters advance as the scheduler's
    would. Returns each step's SamplerOutput (None where the launch returned None)."""
    results = []
    for step in steps:
        out = SchedulerOutput([ScheduledRequest(r, n) for r, n in step])
        pending = runner.launch(out)
        results.append(pending.resolve() if pending is not None else None)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
    return results


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def assert_matches_hf(entries, start: int, ref: torch.Tensor, tokens: list[int], k: int) -> None:
    for j, (logprob, rank, top) in enumerate(entries):
        p = start + j
        row = ref[p]
        target = tokens[p + 1]
        assert logprob == pytest.approx(row[target].item(), abs=1e-4)
        assert rank == int((row > row[target]).sum()) + 1
        vals, ids = row.topk(k)
        assert list(top) == ids.tolist()
        assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-4)


def test_chunked_prefill_prompt_logprobs_match_hf(runner, hf_model):
    blocks = Blocks()
    a = blocks.give(Request("a", prompt(13, 0), SamplingParams(temperature=0.0, prompt_logprobs=3), 4))
    b = blocks.give(Request("b", prompt(9, 1), SamplingParams(temperature=0.0, prompt_logprobs=0), 4))
    plain = blocks.give(Request("plain", prompt(7, 2), SamplingParams(temperature=0.0), 4))
    # a: 5 + 1 + 7 tokens (the one-token chunk samples nothing); b: 9 at once beside plain's 7.
    steps = [[(a, 5), (plain, 7)], [(a, 1), (b, 9)], [(a, 7)]]
    results = run_chunks(runner, steps)
    first, second, third = results
    assert first.prompt_logprobs.keys() == {"a"}
    assert second.prompt_logprobs.keys() == {"a", "b"}
    assert third.prompt_logprobs.keys() == {"a"}
    # The positions of a's chunks follow one another and stop before the last prompt token.
    a_chunks = [r.prompt_logprobs["a"] for r in results]
    assert [(start, len(e)) for start, e in a_chunks] == [(0, 5), (5, 1), (6, 6)]
    ref_a = hf_prompt_logprobs(hf_model, a.prompt_token_ids)
    for start, entries in a_chunks:
        assert_matches_hf(entries, start, ref_a, a.prompt_token_ids, 3)
    start, entries = second.prompt_logprobs["b"]
    assert (start, len(entries)) == (0, 8)
    assert_matches_hf(entries, start, hf_prompt_logprobs(hf_model, b.prompt_token_ids), b.prompt_token_ids, 0)
    # The sampled tokens are still the greedy next tokens of the whole prompts.
    assert first.token_ids == [int(hf_prompt_logprobs(hf_model, plain.prompt_token_ids + [0])[-1].argmax())]
    assert second.token_ids == [int(hf_prompt_logprobs(hf_model, b.prompt_token_ids + [0])[-1].argmax())]
    assert third.token_ids == [int(hf_prompt_logprobs(hf_model, a.prompt_token_ids + [0])[-1].argmax())]


def test_a_step_that_samples_nothing_still_returns_prompt_logprobs(runner, hf_model):
    blocks = Blocks()
    blocks.next = 32
    a = blocks.give(Request("a", prompt(12, 3), SamplingParams(temperature=0.0, prompt_logprobs=2), 4))
    plain = blocks.give(Request("plain", prompt(12, 4), SamplingParams(temperature=0.0), 4))
    with_logprobs, without, plain_samples = run_chunks(runner, [[(a, 6)], [(plain, 6)], [(plain, 6)]])
    assert with_logprobs.token_ids == [] and with_logprobs.logprobs is None
    start, entries = with_logprobs.prompt_logprobs["a"]
    assert (start, len(entries)) == (0, 6)
    assert_matches_hf(entries, 0, hf_prompt_logprobs(hf_model, a.prompt_token_ids), a.prompt_token_ids, 2)
    assert without is None  # as before: a chunk that samples nothing and asks nothing has no result
    assert plain_samples.prompt_logprobs is None and len(plain_samples.token_ids) == 1


def test_rerun_after_recompute_reports_the_positions_again_and_output_rows_add_nothing(runner, hf_model):
    blocks = Blocks()
    blocks.next = 48
    a = blocks.give(Request("a", prompt(6, 5), SamplingParams(temperature=0.0, prompt_logprobs=1), 4))
    (first,) = run_chunks(runner, [[(a, 6)]])
    a.append_output_token(first.token_ids[0])
    a.num_computed_tokens = 0  # preempted by recompute: prompt and output run again
    (again,) = run_chunks(runner, [[(a, 7)]])
    assert again.prompt_logprobs["a"][0] == 0 and len(again.prompt_logprobs["a"][1]) == 5
    assert_matches_hf(again.prompt_logprobs["a"][1], 0, hf_prompt_logprobs(hf_model, a.prompt_token_ids),
                      a.prompt_token_ids, 1)
    a.record_prompt_logprobs(*first.prompt_logprobs["a"])
    recorded = list(a.prompt_logprobs)
    a.record_prompt_logprobs(*again.prompt_logprobs["a"])
    assert a.prompt_logprobs == recorded and len(recorded) == 6
