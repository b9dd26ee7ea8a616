"""Bad input gets 400 (404, 413, 405) with the OpenAI error body and a string code: never a 500,
never FastAPI's 422, and the server keeps serving afterwards."""

from __future__ import annotations

import pytest

from apitest_server import MAIN_SERVER, MODEL, assert_error, get_server

SERVERS = {"main": MAIN_SERVER}

OK_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http():
    with get_server("main").http() as client:
        yield client


def completion(**fields):
    return {**OK_COMPLETION, **fields}


def chat(**fields):
    return {**OK_CHAT, **fields}


BAD_JSON = [
    # (route, body, param, code)
    ("completions", completion(prompt=""), "prompt", None),
    ("completions", completion(prompt=[]), "prompt", None),
    ("completions", completion(prompt=[[]]), "prompt", None),
    ("completions", completion(prompt=[1] * 600), "prompt", "context_length_exceeded"),
    ("completions", completion(prompt=[1] * 100, max_tokens=500), "max_tokens", "context_length_exceeded"),
    ("completions", completion(prompt=[10**9]), "prompt", None),
    ("completions", completion(prompt=[-1]), "prompt", None),
    ("completions", completion(max_tokens=0), "max_tokens", None),
    ("completions", completion(max_tokens=-5), "max_tokens", None),
    ("completions", completion(temperature=-0.5), "temperature", None),
    ("completions", completion(top_p=0), "top_p", None),
    ("completions", completion(top_p=1.5), "top_p", None),
    ("completions", completion(n=0), "n", None),
    ("completions", completion(n=10**6), "n", None),
    ("completions", completion(logit_bias={"abc": 1}), "logit_bias", None),
    ("completions", completion(logit_bias={"-3": 1}), "logit_bias", None),
    ("completions", completion(logit_bias={"99999999": 1}), "logit_bias", None),
    ("completions", completion(logit_bias={"5": 1000}), "logit_bias", None),
    ("completions", completion(stop=""), "stop", None),
    ("completions", completion(stop=["ok", ""]), "stop", None),
    ("completions", completion(presence_penalty=5), "presence_penalty", None),
    ("completions", completion(logprobs=50), "logprobs", None),
    ("completions", completion(top_k=0), "top_k", None),
    ("completions", completion(min_tokens=5, max_tokens=2), "min_tokens", None),
    ("completions", completion(temperature="hot"), "temperature", "invalid_type"),
    ("completions", completion(max_tokens="5"), "max_tokens", "invalid_type"),
    ("completions", completion(max_tokens=2.5), "max_tokens", "invalid_type"),
    ("completions", completion(n=True), "n", "invalid_type"),
    ("completions", completion(prompt=5), "prompt", None),
    ("completions", completion(prompt=[1, "a"]), "prompt", None),
    ("completions", completion(prompt={"text": "x"}), "prompt", None),
    ("completions", completion(stream="yes"), "stream", "invalid_type"),
    ("completions", completion(stop=[1]), "stop", None),
    ("completions", completion(seed="x"), "seed", "invalid_type"),
    ("completions", {"model": MODEL}, "prompt", "missing_required_parameter"),
    ("chat/completions", chat(messages=[]), "messages", None),
    ("chat/completions", chat(messages="hi"), "messages", "invalid_type"),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), "messages", None),
    ("chat/completions", chat(messages=[{"content": "x"}]), "messages", "missing_required_parameter"),
    ("chat/completions", chat(max_completion_tokens=0), "max_completion_tokens", None),
    ("chat/completions", chat(max_tokens=0), "max_tokens", None),
    ("chat/completions", chat(max_tokens=1000), "max_tokens", "context_length_exceeded"),
    ("chat/completions", chat(top_logprobs=2), "top_logprobs", None),
    ("chat/completions", chat(logprobs=True, top_logprobs=99), "top_logprobs", None),
    ("chat/completions", chat(temperature=-1), "temperature", None),
]


@pytest.mark.parametrize("route,body,param,code", BAD_JSON, ids=[f"{r}-{i}" for i, (r, *_) in enumerate(BAD_JSON)])
def test_bad_field_is_400(http, route, body, param, code):
    assert_error(http.post(f"/v1/{route}", json=body), 400, param, code)


BAD_RAW = [
    b"{not json",
    b"",
    b"[1, 2]",
    b'"a string"',
    b"null",
    b"42",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "temperature": 1e999}',
    b'{"prompt": "x", "top_p": -1e999}',
    b"\xff\xfe",
]


@pytest.mark.parametrize("raw", BAD_RAW)
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_body_is_400(http, route, raw):
    assert_error(http.post(f"/v1/{route}", content=raw, headers={"Content-Type": "application/json"}), 400)


def test_unknown_model_is_404_and_echo_is_capped(http):
    err = assert_error(http.post("/v1/completions", json=completion(model="x" * 60_000)), 404, "model",
                       "model_not_found")
    assert len(err["message"]) <= 600
    assert_error(http.post("/v1/chat/completions", json=chat(model="gpt-none")), 404, "model", "model_not_found")


def test_huge_bad_value_is_capped(http):
    resp = http.post("/v1/completions", json=completion(stop=["ok"] + [""] * 2000, user="u" * 30_000))
    assert_error(resp, 400, "stop")
    assert len(resp.content) < 2000


def test_body_over_limit_is_413(http):
    resp = http.post("/v1/completions", json=completion(prompt="x " * 40_000))  # > 64 KiB (the test server's limit)
    assert_error(resp, 413, None, "request_too_large")


def test_wrong_method_and_route(http):
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.get("/v1/nothing-here"), 404)


def test_still_serving_after_bad_input(http):
    resp = http.post("/v1/completions", json=completion())
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
