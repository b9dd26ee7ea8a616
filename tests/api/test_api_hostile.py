"""Hostile input against a real server process on the real engine: huge and negative integers in
every integer field, lone surrogates in every string field, non-finite float literals in every
float field, every field with values of the wrong type, malformed bodies and content types, odd
chat messages and colliding chat-template keys, duplicate and odd request ids, and random mixes
of all of these, each streamed and not.

Whatever comes in: no 5xx, an OpenAI error body on every 4xx, well-formed 200s; after every batch
of concurrent requests the server still serves a fresh completion within 5 s; /health stays 200
throughout; and at the end no request runs and no KV block is held.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from apitest_hostile_bodies import (
    CHAT, COMPLETIONS, CONFUSION, FLOAT_FIELDS, FLOAT_LITERALS, HUGE_INT_LITERAL, HUGE_INTS,
    INT_FIELDS, ROUTES, STR_FIELDS, SURROGATES, HostileRequest, all_fields, build, encode,
    hostile_request, nested, sweep,
)
from apitest_hostile_checks import HOSTILE_SERVER, HostileRun, live_server, stop_restarted, wait_idle
from apitest_server import MODEL

SERVERS = {"hostile": HOSTILE_SERVER}
BATCH = 32
RANDOM_BATCHES = 8

# Requests each test must send, so the suite cannot shrink unnoticed.
MIN_REQUESTS = {
    "huge_ints": 520, "surrogates": 120, "floats": 190, "type_confusion": 1000, "malformed": 80,
    "chat_shapes": 140, "request_ids": 40, "random": RANDOM_BATCHES * BATCH,
}
assert sum(MIN_REQUESTS.values()) >= 2000


@pytest.fixture(scope="module", autouse=True)
def _stop_restarted():
    yield
    stop_restarted()


@pytest.fixture
def server():
    return live_server("hostile", HOSTILE_SERVER)


def run_all(server, requests, minimum: int) -> None:
    run = HostileRun(server, BATCH).run(requests)
    idle = None if run.dead else wait_idle(server)
    problems = run.report()
    assert not run.problems and idle is None, f"{problems}\n{idle or ''}"
    assert run.sent >= minimum, f"only {run.sent} requests were sent, expected at least {minimum}"


def test_huge_and_negative_ints_in_every_int_field(server):
    run_all(server, sweep(INT_FIELDS, HUGE_INTS + [HUGE_INT_LITERAL]), MIN_REQUESTS["huge_ints"])


def test_lone_surrogates_in_every_string_field(server):
    run_all(server, sweep(STR_FIELDS, SURROGATES), MIN_REQUESTS["surrogates"])


def test_non_finite_literals_in_every_float_field(server):
    run_all(server, sweep(FLOAT_FIELDS, FLOAT_LITERALS), MIN_REQUESTS["floats"])


def test_wrong_types_and_null_in_every_field(server):
    fields = {route: all_fields(route) for route in ROUTES}
    requests = list(sweep(fields, CONFUSION))
    for route in ROUTES:
        for stream in (False, True):
            null = {f.name: None for f in all_fields(route) if f.name.isidentifier()}
            null["stream"] = stream
            requests.append(HostileRequest(route, encode(null).encode(), f"every field null stream={stream}"))
    run_all(server, requests, MIN_REQUESTS["type_confusion"])


def _raw(body: bytes, label: str, content_type: str | None = "application/json") -> list[HostileRequest]:
    return [HostileRequest(route, body, label, content_type) for route in ROUTES]


# A valid body for either route (each ignores the other's prompt field).
OK = encode({"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 2}).encode()


def _malformed() -> list[HostileRequest]:
    bodies = [
        (b"", "empty body"), (b" ", "blank body"), (b"{", "truncated object"), (b"{}", "empty object"),
        (b"null", "null"), (b"[]", "empty array"), (b"[{}]", "array of object"), (b"42", "number"),
        (b'"text"', "string"), (b"true", "true"), (b"NaN", "NaN body"), (b"Infinity", "Infinity body"),
        (b"\xff\xfe\x00", "not UTF-8"), (b'{"prompt": "\xed\xa0\x80"}', "UTF-8-encoded surrogate bytes"),
        (b"\xef\xbb\xbf" + OK, "UTF-8 BOM"), (OK[:-1], "truncated request"), (OK + b" trailing", "trailing garbage"),
        (OK[:-1] + b', "max_tokens": 99999}', "duplicate key, second over bounds"),
        (OK[:-1] + b', "max_tokens": "x"}', "duplicate key, second of wrong type"),
        (encode(nested(1000)).encode(), "array nested 1000 deep"),
        (b'{"a": ' * 1000 + b"1" + b"}" * 1000, "object nested 1000 deep"),
        (OK[:-1] + b', "prompt": ' + encode(nested(1000)).encode() + b"}", "prompt nested 1000 deep"),
        (OK[:-1] + b', "messages": ' + encode(nested(1000, "{}")).encode() + b"}", "messages nested 1000 deep"),
        (OK[:-1] + b', "logit_bias": ' + b'{"1": ' * 500 + b"1" + b"}" * 500 + b"}", "logit_bias nested 500 deep"),
        (str(HUGE_INT_LITERAL).encode(), "5000-digit integer body"),
        (OK[:-1] + b', "prompt": "' + b"x " * 100_000 + b'"}', "200 KB prompt"),
        (OK[:-1] + b', "prompt": "' + b"x" * 300_000 + b'"}', "body over the size limit"),
        (OK[:-1] + b', "prompt": [' + b"1," * 60_000 + b'1]}', "60k token ids"),
        (OK[:-1] + b', "prompt": [' + b'"hi",' * 199 + b'"hi"]}', "200 prompts"),
        (b'{"\x00": 1, "prompt": "\\u0000", "max_tokens": 2}', "NUL in key and prompt"),
        (OK[:-1] + b', "stream": true, "stream_options": {"include_usage": true}}', "usage chunk"),
    ]
    out = [r for body, label in bodies for r in _raw(body, label)]
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/json; charset=utf-16", "application/xml", "*/*", "application/json\x7f"):
        out += _raw(OK, f"content type {content_type!r}", content_type)
    out += _raw(OK.decode().encode("utf-16"), "UTF-16 body", "application/json; charset=utf-16")
    out += _raw(b"prompt=hi&max_tokens=2", "form body", "application/x-www-form-urlencoded")
    return out


def test_malformed_bodies_and_content_types(server):
    run_all(server, _malformed(), MIN_REQUESTS["malformed"])


_MESSAGES = [
    [{"role": "user", "content": None}],
    [{"role": "assistant", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
    [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "text", "text": None}]}],
    [{"role": "user", "content": [{"text": "hi"}]}],
    [{"role": "user", "content": {"type": "text", "text": "hi"}}],
    [{"role": "wizard", "content": "hi"}], [{"role": "", "content": "hi"}], [{"role": "USER", "content": "hi"}],
    [{"role": "function", "content": "hi"}], [{"role": None, "content": "hi"}], [{"content": "hi"}],
    [{"role": "system", "content": "be brief"}],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
     {"role": "tool", "tool_call_id": "call_0", "content": "42"}],
    [{"role": "assistant", "content": None, "tool_calls": 5}],
    [{"role": "assistant", "content": None, "tool_calls": "x"}],
    [{"role": "assistant", "content": None, "tool_calls": [{}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": None, "arguments": None}}]}],
    [{"role": "tool", "content": "42"}],
    [{"role": "tool", "tool_call_id": 5, "content": "42"}],
    [{"role": "user", "content": "hi", "name": 5}],
    [{"role": "user", "content": "hi", "weight": 5, "__class__": {}, "content_parts": [1]}],
    [{"role": "user", "content": "hi"}] * 1000,
    [{"role": "user", "content": "hi"}, 5],
    [None],
]

_TEMPLATE_KWARGS = [
    {"messages": 5}, {"messages": []}, {"messages": [{"role": "user", "content": "x"}]}, {"messages": None},
    {"conversation": 5}, {"add_generation_prompt": "x"}, {"add_generation_prompt": None}, {"tokenize": True},
    {"tokenize": False}, {"return_dict": True}, {"return_tensors": "pt"}, {"tools": 5}, {"tools": [{}]},
    {"tools": [5]}, {"documents": 5}, {"documents": [5]}, {"chat_template": 5}, {"chat_template": None},
    {"chat_template": "x"}, {"chat_template": "{{ 1/0 }}"}, {"chat_template": "{% if %}"},
    {"continue_final_message": True}, {"continue_final_message": "x"}, {"bos_token": 5}, {"eos_token": None},
    {"raise_exception": 5}, {"add_special_tokens": "x"}, {"truncation": True, "max_length": 1},
    {"truncation": "x"}, {"max_length": -1}, {"padding": "x"}, {"padding": True, "max_length": 10**9},
    {"tokenizer_kwargs": 5}, {"return_assistant_tokens_mask": True}, {"strftime_now": 5}, {"": 1},
    {"self": 1}, {"__class__": 1}, {"kwargs": 5},
]


def test_chat_messages_and_template_kwargs(server):
    requests = []
    for stream in (False, True):
        for messages in _MESSAGES:
            body = {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": stream}
            label = f"messages={encode(messages)[:80]} stream={stream}"
            requests.append(HostileRequest(CHAT, encode(body).encode(), label))
        for kwargs in _TEMPLATE_KWARGS:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "chat_template_kwargs": kwargs, "stream": stream}
            label = f"chat_template_kwargs={encode(kwargs)[:80]} stream={stream}"
            requests.append(HostileRequest(CHAT, encode(body).encode(), label))
    run_all(server, requests, MIN_REQUESTS["chat_shapes"])


def _with_id(route: str, value: bytes, stream: bool) -> HostileRequest:
    base = build(route, [], stream)
    return HostileRequest(route, base.body, f"X-Request-Id={value[:40]!r} stream={stream}",
                          headers=(("X-Request-Id", value),))


def test_duplicate_and_odd_request_ids(server):
    # Concurrent requests sharing an id: each one is served or refused, none takes down or
    # leaks another.
    requests = [_with_id(ROUTES[i % 2], b"dup-%d" % (i % 4), i % 3 == 0) for i in range(BATCH)]
    for value in (b"", b"x" * 8000, b"\xff\xfe", "\u00e9t\u00e9".encode(), b"../../etc/passwd", b"a b\tc",
                  b"cmpl-x", b"chatcmpl-y", b"%00", b"\x7f"):
        for stream in (False, True):
            requests.append(_with_id(COMPLETIONS, value, stream))
    twice = build(CHAT, [], True)
    requests.append(HostileRequest(CHAT, twice.body, "two X-Request-Id headers",
                                   headers=(("X-Request-Id", b"twice-a"), ("X-Request-Id", b"twice-b"))))
    run_all(server, requests, MIN_REQUESTS["request_ids"])


def test_random_mutations(server):
    run = HostileRun(server, BATCH)

    # No shrinking: the problems are collected over every batch and reported by request, and
    # re-running batches to shrink one would cost minutes against a real server.
    @settings(max_examples=RANDOM_BATCHES, phases=[Phase.generate], deadline=None, database=None,
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(st.lists(hostile_request(), min_size=BATCH, max_size=BATCH))
    def one_batch(batch):
        if not run.dead:
            run.run(batch)

    one_batch()
    idle = None if run.dead else wait_idle(server)
    assert not run.problems and idle is None, f"{run.report()}\n{idle or ''}"
    assert run.sent >= MIN_REQUESTS["random"], f"only {run.sent} requests were sent"
