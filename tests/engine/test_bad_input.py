"""Bad input is a clear exception naming the parameter, and the engine keeps serving."""

from __future__ import annotations

import pytest

from deepbatch import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=128)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
        (dict(stop=[""]), "stop"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=50), "logprobs"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    ],
)
def test_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt") as e:
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    assert e.value.param == "prompt"


def test_prompt_over_max_model_len(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([{"prompt_token_ids": [5] * 200}], use_tqdm=False)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"


def test_prompt_plus_max_tokens_over_context(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=50), use_tqdm=False)
    assert e.value.param == "max_tokens"


def test_token_id_out_of_vocab(llm):
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([{"prompt_token_ids": [5, 10**6]}], use_tqdm=False)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate(["hello"], use_tqdm=False)


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model"):
        LLM(str(tmp_path / "no-such-model"), device="cpu")


def test_bad_request_queues_nothing_and_engine_keeps_serving(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(InvalidRequestError):
        llm.generate([good, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([good, good], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_engine_serves_others_when_one_request_is_bad(llm):
    engine = llm.engine
    engine.add_request("ok-1", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [5] * 500, SamplingParams(max_tokens=3))
    engine.add_request("ok-2", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert sorted(done) == ["ok-1", "ok-2"]
    assert all(len(o.outputs[0].token_ids) == 3 for o in done.values())


def test_duplicate_request_id_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
