"""A fault in one request's sampling or detokenization ends that request alone: the engine goes
on and every other request in the same steps gets exactly the tokens it gets without the fault."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepbatch import LLM, InvalidRequestError, SamplingParams
from deepbatch.engine.llm_engine import LLMEngine

PROMPTS = {f"ok-{i}": [11 + i, 12, 13, 14, 15 + i] for i in range(4)}
VICTIM = "victim"
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def base_config(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=128).engine.config


def run(engine: LLMEngine, victim_params: SamplingParams = PARAMS, max_steps: int = 200) -> dict:
    engine.add_request(VICTIM, {"prompt_token_ids": [40, 41, 42]}, victim_params)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, PARAMS)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage() == 0.0  # every block came back
    return done


@pytest.fixture(scope="module")
def reference(base_config):
    return run(LLMEngine(base_config))


def assert_only_victim_failed(done: dict, reference: dict, why: str) -> None:
    victim = done[VICTIM]
    assert victim.error is not None and why in victim.error, victim.error
    assert victim.outputs[0].finish_reason == "error"
    for rid in PROMPTS:
        assert done[rid].error is None
        assert done[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_injected_sampling_fault_fails_one_request(base_config, reference, async_scheduling):
    config = dataclasses.replace(base_config, fault_inject_sample_request=VICTIM, async_scheduling=async_scheduling)
    engine = LLMEngine(config)
    assert_only_victim_failed(run(engine), reference, "injected sampling fault")
    # The same engine still serves: a fresh request after the fault runs to its end.
    engine.add_request("fresh", {"prompt_token_ids": PROMPTS["ok-0"]}, PARAMS)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].error is None and outs[0].outputs[0].token_ids == reference["ok-0"].outputs[0].token_ids


def test_nan_logits_fail_only_that_request(base_config, reference):
    engine = LLMEngine(base_config)
    sample = engine.runner.sampler.sample

    def poisoned(logits, requests, *previous):
        rows = [i for i, r in enumerate(requests) if r.request_id == VICTIM]
        if rows:
            logits = logits.clone()
            logits[rows[0], 7] = float("nan")
        return sample(logits, requests, *previous)

    engine.runner.sampler.sample = poisoned
    assert_only_victim_failed(run(engine), reference, "NaN logits")


def test_detokenizer_fault_fails_only_that_request(base_config, reference):
    engine = LLMEngine(base_config)
    update = engine.outputs.detokenizer.update

    def failing(request, token_ids):
        if request.request_id == VICTIM and request.num_output_tokens == 3:
            raise ValueError("cannot decode")
        return update(request, token_ids)

    engine.outputs.detokenizer.update = failing
    done = run(engine)
    assert_only_victim_failed(done, reference, "detokenization failed")
    assert len(done[VICTIM].outputs[0].token_ids) == 3


def test_a_batch_that_raises_is_sampled_row_by_row(base_config, reference):
    # A processor that raises only when the victim shares the batch: the row-by-row retry
    # samples every other row normally.
    engine = LLMEngine(base_config)
    sampler = engine.runner.sampler
    batch = sampler._sample_batch

    def fragile(logits, requests):
        if any(r.request_id == VICTIM for r in requests):
            raise IndexError("index 10**9 is out of bounds")
        return batch(logits, requests)

    sampler._sample_batch = fragile
    assert_only_victim_failed(run(engine), reference, "IndexError")


def test_stop_token_ids_outside_the_vocab_are_refused(base_config):
    engine = LLMEngine(base_config)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[10**9], min_tokens=2))
    assert e.value.param == "stop_token_ids"


def test_untokenizable_prompt_is_an_invalid_request(smollm_llm):
    with pytest.raises(InvalidRequestError) as e:
        smollm_llm.generate(["a\ud800b"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
