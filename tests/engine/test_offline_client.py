"""``LLM`` over the engine core process (``DEEPBATCH_LLM_ENGINE_PROCESS=1``): the same outputs as
the engine stepped in this process (text made on this side, stop strings included), bad input
refused before anything is queued, and the core process gone after ``shutdown``."""

from __future__ import annotations

import os

import pytest

from deepbatch import LLM, SamplingParams
from deepbatch.core.errors import InvalidRequestError

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=20),
    SamplingParams(temperature=0.0, max_tokens=40, stop=[" 9"], include_stop_str_in_output=False),
]


@pytest.fixture(scope="module")
def split_llm(monkeypatch_module):
    monkeypatch_module.setenv("DEEPBATCH_LLM_ENGINE_PROCESS", "1")
    llm = LLM(max_model_len=1024, dtype="float32", device="cpu")  # as the smollm_llm fixture
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_outputs_equal_the_engine_stepped_in_this_process(split_llm, smollm_llm):
    want = smollm_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = split_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.request_id for o in got] == ["0", "1", "2"]  # in input order
    for g, w, params in zip(got, want, PARAMS):
        assert g.finished and g.prompt_token_ids == w.prompt_token_ids and len(g.outputs) == params.n
        for a, b in zip(g.outputs, w.outputs):
            assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == \
                (b.index, b.text, b.token_ids, b.finish_reason, b.stop_reason)
            assert (a.logprobs is None) == (b.logprobs is None) and len(a.logprobs or []) == len(b.logprobs or [])
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
    assert got[2].outputs[0].stop_reason == " 9"  # found on this side of the split
    chat = split_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=6),
                          use_tqdm=False)
    assert chat[0].outputs[0].text == smollm_llm.chat([{"role": "user", "content": "Hi"}],
                                                      SamplingParams(temperature=0.0, max_tokens=6),
                                                      use_tqdm=False)[0].outputs[0].text


def test_bad_input_is_refused_before_anything_is_queued(split_llm):
    with pytest.raises(InvalidRequestError) as err:
        split_llm.generate(["fine", {"prompt_token_ids": [10 ** 9]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert err.value.param == "prompt"
    assert split_llm._core.num_open == 0
    out = split_llm.generate(["fine"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_shutdown_stops_the_core_process():
    os.environ["DEEPBATCH_LLM_ENGINE_PROCESS"] = "1"
    try:
        llm = LLM(max_model_len=256, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    finally:
        del os.environ["DEEPBATCH_LLM_ENGINE_PROCESS"]
    process = llm._core._core.process
    assert process.is_alive()
    llm.shutdown()
    assert not process.is_alive() and process.exitcode == 0
    llm.shutdown()  # idempotent
