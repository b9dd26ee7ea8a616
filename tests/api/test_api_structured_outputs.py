"""Structured outputs through the official client against a real server process: 20 JSON schemas
whose every choice validates with ``jsonschema`` (streamed and not, n=2, sampled), regexes,
choices and an EBNF grammar that the output matches, ``json_object``, each spelling clients use
(``response_format``, ``structured_outputs``, ``guided_*``) on both routes, and the 400s of
schemas xgrammar cannot compile, malformed ones and two constraints at once."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from apitest_server import MODEL, assert_error
from apitest_streams import collect, collect_async
from apitest_structured import SCHEMAS, STRUCTURED_SERVER, constraint_fields, schema_problem
from apitest_structured import server, client  # noqa: F401  (fixtures)

SERVERS = {"structured": STRUCTURED_SERVER}
# Ample for every schema's JSON; a choice that needs more counts as a failure (finish_reason).
MAX_TOKENS = 160


def _messages(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON value for '{name}'."}]


@pytest.fixture(scope="module")
def schema_outputs(server):
    """``{(name, streamed): [(text, finish_reason), ...]}`` for every schema, all requests at once
    (they batch), each with n=2 sampled choices."""
    client = server.async_client()

    async def one(name: str, stream: bool):
        kwargs = dict(model=MODEL, messages=_messages(name), max_tokens=MAX_TOKENS, n=2, temperature=0.6,
                      top_p=0.9, seed=1, extra_body=constraint_fields(name))
        if stream:
            choices = await collect_async(await client.chat.completions.create(**kwargs, stream=True))
            return [(c.content, c.finish_reason) for _, c in sorted(choices.items())]
        out = await client.chat.completions.create(**kwargs)
        return [(c.message.content, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]

    async def run():
        keys = [(name, stream) for name in SCHEMAS for stream in (False, True)]
        results = await asyncio.gather(*(one(*key) for key in keys))
        await client.close()
        return dict(zip(keys, results))

    return asyncio.run(run())


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_choice_validates_against_its_schema(schema_outputs, name):
    for stream in (False, True):
        choices = schema_outputs[(name, stream)]
        assert len(choices) == 2
        for text, reason in choices:
            assert reason == "stop", (name, stream, reason, text)
            problem = schema_problem(name, text)
            assert problem is None, (name, stream, problem)


REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["apple", "banana", "cherry"]
CONSTRAINTS = [
    ("regex", {"guided_regex": REGEX}),
    ("regex", {"structured_outputs": {"regex": REGEX}}),
    ("choice", {"guided_choice": CHOICES}),
    ("choice", {"structured_outputs": {"choice": CHOICES}}),
]


def _matches(kind: str, text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None if kind == "regex" else text in CHOICES


@pytest.mark.parametrize("kind,fields", CONSTRAINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_on_completions(client, kind, fields, stream):
    kwargs = dict(model=MODEL, prompt="My favourite is", max_tokens=20, n=2, temperature=1.0, seed=7,
                  extra_body=fields)
    if stream:
        texts, reasons = {}, {}
        for chunk in client.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        got = [(texts[i], reasons[i]) for i in sorted(texts)]
    else:
        got = [(c.text, c.finish_reason) for c in client.completions.create(**kwargs).choices]
    assert len(got) == 2
    for text, reason in got:
        assert reason == "stop" and _matches(kind, text), (text, reason)


@pytest.mark.parametrize("kind,fields", CONSTRAINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_on_chat(client, kind, fields, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Pick one."}], max_tokens=20, temperature=0,
                  extra_body=fields)
    if stream:
        got = collect(client.chat.completions.create(**kwargs, stream=True))[0]
        text, reason = got.content, got.finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    assert reason == "stop" and _matches(kind, text), (text, reason)


def test_ebnf_grammar(client):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    for fields in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        out = client.completions.create(model=MODEL, prompt="Question: is the sky blue?", max_tokens=20,
                                        temperature=0, extra_body=fields)
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"The answer is (yes|no)\.", out.choices[0].text), out.choices[0].text


def test_json_object(client):
    for fields in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON with two short keys."}],
            max_tokens=MAX_TOKENS, temperature=0, extra_body=fields)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_text_format_and_json_schema_on_completions(client):
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain.choices[0].text  # "text" is no constraint
    out = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body=constraint_fields("person"))
    assert out.choices[0].finish_reason == "stop"
    assert schema_problem("person", out.choices[0].text) is None


# A schema xgrammar cannot compile, a malformed one, a bad regex or grammar: 400 naming the field.
UNCOMPILABLE = {"type": "string", "minLength": 5, "maxLength": 2}
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNCOMPILABLE}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"json": UNCOMPILABLE}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": UNCOMPILABLE}, "guided_json"),
    ({"guided_json": "[1, 2"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    # Two constraints at once: the second is named.
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("fields,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_field(server, route, fields, param):
    base = ({"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    with server.http() as http:
        resp = http.post(f"/v1/{route}", json={"model": MODEL, "max_tokens": 4, **base, **fields})
    assert_error(resp, 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_vocabulary_cannot_complete_is_a_client_error(server, stream):
    """A regex past whose start no token fits (a character the tokenizer cannot produce): a 400
    before any output, or an error event in a stream, never a 500."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": stream, "guided_regex": "a\U000B335E"}
    with server.http() as http:
        resp = http.post("/v1/completions", json=body)
    if not stream:
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_grammar"
        assert "cannot be completed" in resp.json()["error"]["message"]
    else:
        assert resp.status_code == 200
        events = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and errors[0]["code"] == "invalid_grammar", resp.text[-500:]


def test_xgrammar_backends_are_accepted(client):
    for backend in ("xgrammar", "auto"):
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                        extra_body={"guided_choice": ["on", "off"], "guided_decoding_backend": backend})
        assert out.choices[0].text in ("on", "off")
