"""Request bodies and headers at the edges of what the OpenAI endpoints accept, against a real
server process: every one either succeeds or gets a 4xx with the OpenAI error body that names
the field (lone surrogates in any string, integers past their type, template arguments that
collide with the template call, queue bounds no retry can meet, odd X-Request-Id headers);
OpenAI-shaped tool turns render through the chat template; and a full queue's 429 carries a
Retry-After. The API-key tenant binding and the end of a failing stream are checked in-process.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from apitest_fakes import FakeEngine
from apitest_server import MODEL, assert_error, get_server
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.api.responses import StreamSpec as _StreamSpec
from deepbatch.api.serving import OpenAIServing
from deepbatch.engine.async_engine import AsyncEngine
from deepbatch.core.errors import InvalidRequestError
from deepbatch.engine.request_stream import RequestStream

QUEUED_REQUESTS, QUEUED_TOKENS = 3, 600
SERVERS = {"edges": dict(
    # One seat, so a few requests fill the small waiting queue.
    args=["--num-gpu-blocks-override", "1024", "--max-num-seqs", "1",
          "--max-queued-requests", str(QUEUED_REQUESTS), "--max-queued-tokens", str(QUEUED_TOKENS)],
    env={"DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST": "cmpl-fault-me"},
)}

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ROUTE = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {"completions": COMPLETION, "chat": CHAT}


@pytest.fixture(scope="module")
def http():
    with get_server("edges").http() as client:
        yield client


def post(http, route: str, headers: dict | None = None, **fields):
    # json.dumps escapes a lone surrogate as "\udXXX", as a client's JSON encoder would.
    body = json.dumps({**BASE[route], **fields}).encode()
    return http.post(ROUTE[route], content=body, headers={"Content-Type": "application/json", **(headers or {})})


def tool_turns(assistant: dict) -> list[dict]:
    return [{"role": "user", "content": "What is 6 x 7?"}, assistant,
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}, {"role": "user", "content": "Thanks"}]


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}
S = "a\ud800b"

SURROGATES = [
    ("completions", {"prompt": S}, "prompt"),
    ("completions", {"prompt": ["ok", "x\udfff"]}, "prompt[1]"),
    ("completions", {"stop": ["x", S]}, "stop[1]"),
    ("completions", {"stop": S}, "stop"),
    ("completions", {"user": S}, "user"),
    ("completions", {"model": S}, "model"),
    ("completions", {"logit_bias": {S: 1}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": S}]}]}, "messages[1].content[1].text"),
    ("chat", {"messages": [{"role": "user", "content": "ok", "name": S}]}, "messages[0].name"),
    ("chat", {"messages": tool_turns({"role": "assistant", "content": None, "tool_calls": [
        {**TOOL_CALL, "function": {"name": "f", "arguments": S}}]})}, "messages[1].tool_calls[0].function.arguments"),
    ("chat", {"messages": tool_turns({"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]})[:2]
              + [{"role": "tool", "tool_call_id": S, "content": "42"}]}, "messages[2].tool_call_id"),
    ("chat", {"chat_template_kwargs": {"greeting": ["ok", S]}}, "chat_template_kwargs.greeting[1]"),
    ("chat", {"chat_template_kwargs": {S: 1}}, "chat_template_kwargs"),
    ("chat", {"stop": [S]}, "stop[0]"),
]


@pytest.mark.parametrize("route,fields,param", SURROGATES, ids=[p for *_, p in SURROGATES])
def test_lone_surrogate_is_400_naming_the_field(http, route, fields, param):
    for stream in (False, True):
        assert_error(post(http, route, stream=stream, **fields), 400, param, "invalid_encoding")


def test_still_serving_and_metrics_render_after_bad_text(http):
    assert post(http, "completions", user="tenant-ok").status_code == 200
    assert http.get("/metrics").status_code == 200


BAD_TEMPLATE_KWARGS = [{"messages": 5}, {"self": 1}, {"conversation": []}, {"add_generation_prompt": False},
                       {"tokenize": False}, {"return_dict": False}, {"return_tensors": "pt"},
                       {"chat_template": "{{ 1 }}"}, {"tokenizer_kwargs": {}}, {"max_length": 3}, 5, "x", [1]]


@pytest.mark.parametrize("kwargs", BAD_TEMPLATE_KWARGS, ids=[json.dumps(k) for k in BAD_TEMPLATE_KWARGS])
def test_template_kwargs_that_are_not_template_variables_are_400(http, kwargs):
    assert_error(post(http, "chat", chat_template_kwargs=kwargs), 400, "chat_template_kwargs")


def test_template_variables_render_and_template_errors_stay_400(http):
    # Names of the server's own internals are ordinary template variables.
    resp = post(http, "chat", chat_template_kwargs={"fn": 1, "enable_thinking": False, "kwargs": {"a": [1]}})
    assert resp.status_code == 200, resp.text
    assert_error(post(http, "chat", chat_template_kwargs={"tools": 5}), 400, "messages")
    assert_error(post(http, "chat", chat_template_kwargs={"continue_final_message": True}), 400, "messages")


def prompt_tokens(http, messages) -> int:
    resp = post(http, "chat", messages=messages)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def test_assistant_turn_without_content_renders_as_empty_content(http):
    # SmolLM2's template concatenates content: the reference is the same turn with "" spelled out.
    empty = prompt_tokens(http, tool_turns({"role": "assistant", "content": ""}))
    assert prompt_tokens(http, tool_turns({"role": "assistant", "content": None})) == empty
    assert prompt_tokens(http, tool_turns({"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]})) == empty
    assert prompt_tokens(http, tool_turns({"role": "assistant", "tool_calls": [TOOL_CALL]})) == empty
    without = prompt_tokens(http, [m for m in tool_turns({"role": "assistant", "content": ""})
                                   if m["role"] != "assistant"])
    assert empty > without  # the turn is rendered, not dropped


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": None}], [{"role": "tool", "tool_call_id": "c", "content": None}],
    [{"role": "user", "content": "hi", "tool_calls": [TOOL_CALL]}],
    tool_turns({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}),
])
def test_malformed_turns_are_400(http, messages):
    assert_error(post(http, "chat", messages=messages), 400, "messages")


BIG = 2**70
BAD_INTS = [
    ("completions", "max_tokens", 2**31), ("completions", "max_tokens", BIG), ("completions", "n", BIG),
    ("completions", "logprobs", BIG), ("completions", "top_k", 2**31), ("completions", "top_k", BIG),
    ("completions", "min_tokens", BIG), ("completions", "priority", 2**31), ("completions", "priority", -(2**31) - 1),
    ("completions", "seed", 2**64), ("completions", "seed", -1), ("completions", "best_of", BIG),
    ("completions", "stop_token_ids", [1, BIG]), ("completions", "temperature", 10**400),
    ("completions", "top_k", True), ("completions", "top_k", 2.0), ("completions", "priority", 0.5),
    ("chat", "max_completion_tokens", BIG), ("chat", "max_tokens", -BIG), ("chat", "top_logprobs", BIG),
    ("chat", "priority", BIG), ("chat", "seed", BIG),
]


@pytest.mark.parametrize("route,field,value", BAD_INTS, ids=[f"{r}-{f}-{str(v)[:12]}" for r, f, v in BAD_INTS])
def test_numbers_past_their_type_are_400(http, route, field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    assert_error(post(http, route, **{field: value}, **extra), 400, field)


@pytest.mark.parametrize("raw", [b"1e999", b"-1e999", b"1" + b"0" * 400])
def test_non_finite_float_is_400(http, raw):
    body = json.dumps({**COMPLETION, "repetition_penalty": 0}).encode().replace(b'"repetition_penalty": 0',
                                                                                 b'"repetition_penalty": ' + raw)
    resp = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "repetition_penalty")


def test_extremes_within_the_types_are_served(http):
    resp = post(http, "completions", seed=2**64 - 1, n=2, temperature=1.0)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text
    for fields in ({"top_k": 2**31 - 1}, {"priority": -(2**31)}, {"priority": 2**31 - 1}):
        resp = post(http, "completions", **fields)
        assert resp.status_code == 200, (fields, resp.text)


# -- queue bounds ----------------------------------------------------------------------------------

LONG = "one two three four five six seven eight nine ten " * 35  # ~350 tokens: two exceed 600


@pytest.mark.parametrize("route,fields,param", [
    ("completions", {"n": QUEUED_REQUESTS + 1}, "n"),
    ("completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
    ("completions", {"prompt": ["a", "b"], "n": 2}, "prompt"),
    ("completions", {"prompt": LONG, "n": 2}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": LONG}], "n": 2}, "messages"),
    ("chat", {"n": QUEUED_REQUESTS + 1}, "n"),
])
def test_request_beyond_a_queue_bound_is_400_even_when_idle(http, route, fields, param):
    err = assert_error(post(http, route, **fields), 400, param, "exceeds_queue_limit")
    assert str(QUEUED_REQUESTS if "sequences" in err["message"] else QUEUED_TOKENS) in err["message"]


class Stream:
    """A streaming request read in the background; ``first`` is set at its first chunk."""

    def __init__(self, client, route: str, headers: dict | None = None, **fields):
        self.first = asyncio.Event()
        self.status: int | None = None
        self.events: list = []
        body = {**BASE[route], **fields, "stream": True}
        self.task = asyncio.ensure_future(self._run(client, ROUTE[route], body, headers or {}))

    async def _run(self, client, path, body, headers):
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            self.status = resp.status_code
            if resp.status_code != 200:
                self.first.set()
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    self.first.set()


async def stop(streams) -> None:
    for s in streams:
        s.task.cancel()
    await asyncio.gather(*(s.task for s in streams), return_exceptions=True)


def test_full_queue_is_429_with_retry_after_and_a_retry_is_served():
    server = get_server("edges")

    async def run():
        async with server.async_http() as client:
            running = Stream(client, "completions", max_tokens=500, ignore_eos=True)
            await asyncio.wait_for(running.first.wait(), 60)
            waiting = [Stream(client, "completions", max_tokens=4) for _ in range(QUEUED_REQUESTS)]
            while any(s.status is None for s in waiting):
                await asyncio.sleep(0.02)
            assert all(s.status == 200 for s in waiting)
            resp = await client.post("/v1/completions", json=COMPLETION)
            assert not running.task.done(), "the running request ended too early for this test"
            assert_error(resp, 429, None, "queue_full")
            # Whole seconds from the measured drain rate (tests/engine/test_async_queue_bounds.py
            # checks the value against a queue that drains at a known rate).
            assert 1 <= int(resp.headers["retry-after"]) <= 60, resp.headers["retry-after"]
            await stop([running, *waiting])
            for _ in range(200):  # the aborted requests leave the queue within a step or two
                resp = await client.post("/v1/completions", json=COMPLETION)
                if resp.status_code != 429:
                    break
                await asyncio.sleep(0.05)
            assert resp.status_code == 200, resp.text

    asyncio.run(run())


# -- X-Request-Id ----------------------------------------------------------------------------------


def test_x_request_id_names_the_request(http):
    rid = {"X-Request-Id": "trace-7.a:b_C"}
    assert post(http, "completions", headers=rid).json()["id"] == "cmpl-trace-7.a:b_C"
    assert post(http, "chat", headers=rid).json()["id"] == "chatcmpl-trace-7.a:b_C"
    text = post(http, "chat", headers=rid, stream=True).text
    lines = [line for line in text.splitlines() if line.startswith("data: {")]
    assert lines and {json.loads(line[6:])["id"] for line in lines} == {"chatcmpl-trace-7.a:b_C"}


@pytest.mark.parametrize("value", [b"", b"a b", b"x" * 129, b"caf\xc3\xa9", b"a/b", b"a\tb"])
def test_malformed_x_request_id_is_400(http, value):
    resp = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": value})
    assert_error(resp, 400, "X-Request-Id")


def test_x_request_id_in_flight_is_taken_then_free_again():
    server = get_server("edges")

    async def run():
        async with server.async_http() as client:
            # "kid" with n=2 holds its samples' ids "cmpl-kid-0" and "cmpl-kid-1" too.
            first = Stream(client, "completions", {"X-Request-Id": "kid"}, max_tokens=400, ignore_eos=True, n=2)
            await asyncio.wait_for(first.first.wait(), 60)
            for taken in ("kid", "kid-1"):
                resp = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": taken})
                assert_error(resp, 400, "X-Request-Id", "duplicate_request_id")
            other = Stream(client, "chat", {"X-Request-Id": "kid"})  # chatcmpl-kid is another id
            await asyncio.wait_for(other.first.wait(), 60)
            assert other.status == 200
            await stop([first, other])
            for _ in range(200):
                resp = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "kid"})
                if resp.status_code != 400:
                    break
                await asyncio.sleep(0.05)
            assert resp.status_code == 200 and resp.json()["id"] == "cmpl-kid", resp.text

    asyncio.run(run())


def test_fault_in_one_request_ends_its_stream_with_an_error_and_done(http):
    # The server injects a sampling fault into the request named cmpl-fault-me.
    resp = post(http, "completions", headers={"X-Request-Id": "fault-me"}, stream=True)
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert post(http, "completions").status_code == 200


# -- in-process: tenant binding and the end of a failing stream ------------------------------------


class TenantEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def make_requests(self, request_id, prompt, params, priority=0, tenant="default", arrival_time=None):
        self.seen.append((tenant, priority))
        return super().make_requests(request_id, prompt, params, priority, tenant, arrival_time)


@pytest.fixture(scope="module")
def fake_app():
    engine = TenantEngine()
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, ServerConfig(log_stats_interval=0))
    async_engine.start()
    yield engine, app
    async_engine.shutdown()


def with_state(app, **state):
    """What the auth gate does for a key from an API-keys file: put its binding on the scope."""
    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "state": {**scope.get("state", {}), **state}}
        await app(scope, receive, send)
    return wrapped


@pytest.mark.parametrize("state,user,tenant", [
    ({"tenant": "acme"}, "bob", "acme"), ({"tenant": "acme"}, None, "acme"), ({}, "bob", "bob"), ({}, None, "default"),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_key_tenant_replaces_the_user_field(fake_app, state, user, tenant, route):
    engine, app = fake_app
    client = TestClient(with_state(app, **state))
    engine.seen.clear()
    resp = client.post(ROUTE[route], json={**BASE[route], "model": None, **({"user": user} if user else {})})
    assert resp.status_code == 200, resp.text
    assert engine.seen == [(tenant, 0)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_priority_above_the_key_ceiling_is_403(fake_app, route):
    engine, app = fake_app
    client = TestClient(with_state(app, tenant="acme", max_priority=0))
    engine.seen.clear()
    err = assert_error(client.post(ROUTE[route], json={**BASE[route], "model": None, "priority": -1}), 403,
                       "priority", "priority_not_allowed")
    assert err["type"] == "permission_error" and engine.seen == []
    for priority in (0, 5):
        assert client.post(ROUTE[route], json={**BASE[route], "model": None, "priority": priority}).status_code == 200
    free = TestClient(with_state(app, tenant="acme", max_priority=None))
    assert free.post(ROUTE[route], json={**BASE[route], "model": None, "priority": -100}).status_code == 200
    assert engine.seen == [("acme", 0), ("acme", 5), ("acme", -100)]


@pytest.mark.parametrize("error", [RuntimeError("boom"), InvalidRequestError("prompt", "refused late")])
@pytest.mark.parametrize("chat", [False, True])
def test_stream_that_fails_ends_with_an_error_event_and_done(error, chat):
    serving = OpenAIServing(AsyncEngine(TenantEngine()), ["fake"])

    async def run():
        stream = RequestStream("cmpl-x", asyncio.get_running_loop())
        stream._fail(error)
        return [e async for e in serving._stream("cmpl-x", [stream], _StreamSpec(1, False, chat=chat))]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["code"] == ("internal_error" if isinstance(error, RuntimeError) else "invalid_value")
