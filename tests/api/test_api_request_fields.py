"""Request fields against a real server process: a field the server does not implement is a 400
that names it (top level and nested, on every route), fields the server knowingly lacks say why,
the OpenAI API's hints are accepted; ``usage.prompt_tokens_details.cached_tokens`` counts the
prefix cache's hits; ``/tokenize`` and ``/detokenize`` in vLLM's shapes round-trip and agree with
what the generation routes count; ``echo``; ``--chat-template`` replaces the model's template."""

from __future__ import annotations

import uuid

import pytest

from apitest_server import MODEL, assert_error, get_server
from apitest_structured import STRUCTURED_SERVER, TEMPLATE_MARK

SERVERS = {"structured": STRUCTURED_SERVER}
BLOCK = 16  # the server's KV block size: the prefix cache shares whole blocks
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


@pytest.fixture(scope="module")
def server():
    return get_server("structured")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return server.client()


UNKNOWN = [
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "strict": True}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parametrs": {}}}],
                              "tool_choice": "none"}, "tools"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ("/v1/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),  # a chat field
    ("/v1/chat/completions", {"prompt": "Hi"}, "prompt"),  # a completions field
]


@pytest.mark.parametrize("route,fields,param", UNKNOWN, ids=[f"{r.split('/')[-1]}-{p}" for r, _, p in UNKNOWN])
def test_unknown_fields_are_400_naming_them(http, route, fields, param):
    err = assert_error(http.post(route, json={**ROUTES[route], **fields}), 400, param, "unknown_parameter")
    assert "unrecognized" in err["message"]


def test_unknown_keys_of_content_parts_are_400(http):
    # Content is a string or a list of parts; the error names the messages either way.
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "messages")


UNSUPPORTED = [
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
]


@pytest.mark.parametrize("route,fields,param", UNSUPPORTED,
                         ids=[f"{r.split('/')[-1]}-{p}" for r, _, p in UNSUPPORTED])
def test_known_unsupported_fields_say_why(http, route, fields, param):
    err = assert_error(http.post(route, json={**ROUTES[route], **fields}), 400, param, "unsupported_parameter")
    assert "not supported: " in err["message"]


def test_modalities_other_than_text_are_400(http):
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "modalities": ["text", "audio"]}), 400, "modalities")


def test_hints_are_accepted(http):
    hints = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k",
             "safety_identifier": "u-1", "prediction": {"type": "content", "content": "Hello"},
             "parallel_tool_calls": True, "modalities": ["text"], "user": "someone"}
    resp = http.post("/v1/chat/completions", json={**CHAT, **hints, "stream": True,
                                                   "stream_options": {"include_usage": True,
                                                                      "include_obfuscation": False}})
    assert resp.status_code == 200, resp.text
    resp = http.post("/v1/completions", json={**COMPLETION, "user": "someone"})
    assert resp.status_code == 200, resp.text


def _long_prompt() -> str:
    # A fresh start, so the first request finds nothing of it in the cache.
    return f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 12


def test_cached_tokens_count_prefix_cache_hits(client):
    prompt = _long_prompt()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    n = first.usage.prompt_tokens
    assert n == again.usage.prompt_tokens and n > 4 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Every full block of the prompt but the last token's (which must run to give logits).
    assert cached % BLOCK == 0 and (n - 1) // BLOCK * BLOCK == cached, (cached, n)


def test_cached_tokens_in_chat_and_in_the_stream_usage(client):
    messages = [{"role": "user", "content": _long_prompt()}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0


def test_tokenize_detokenize_round_trip(http, client):
    text = "Hello, tokenizer! Ünïcödé and numbers 12345."
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 1024
    assert http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json() == {"prompt": text}
    # The same count as a completion of that prompt.
    assert client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens == tok["count"]
    # And for messages, the same prompt as the chat route.
    messages = [{"role": "user", "content": text}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat_usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat_usage.prompt_tokens == chat["count"]
    no_prompt = http.post("/tokenize", json={"model": MODEL, "messages": messages,
                                             "add_generation_prompt": False}).json()
    assert no_prompt["count"] < chat["count"] and chat["tokens"][:no_prompt["count"]] == no_prompt["tokens"]


def test_chat_template_flag_replaces_the_models(http):
    tok = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).json()
    prompt = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()["prompt"]
    assert TEMPLATE_MARK in prompt and "SmolLM" not in prompt


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "extra": 1}, 400, "extra"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                   "continue_final_message": True}, 400, None),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenize_errors(http, path, body, status, param):
    assert_error(http.post(path, json=body), status, param)


def test_echo_puts_the_prompt_before_the_completion(http, client):
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    echo = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text == "The sky is" + plain.choices[0].text
    # A prompt of token ids echoes as their text.
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": "The sky is"}).json()["tokens"]
    echo_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert echo_ids.choices[0].text == echo.choices[0].text


def test_models_lists_max_model_len(http):
    assert [m["max_model_len"] for m in http.get("/v1/models").json()["data"]] == [1024]
