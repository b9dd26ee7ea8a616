"""Tool calling through the official client against a real server process: ``tool_choice``
``required`` and a named function always give calls whose arguments validate against the tool's
schema (streamed and not, n=2), ``parallel_tool_calls`` false gives one call, ``auto`` reads the
calls out of the text with the server's ``--tool-call-parser`` (here Hermes; the text is forced by
a regex so that a small model writes it), ``none`` gives text; the tools and the turns of a tool
conversation reach the chat template (``/tokenize`` shows the rendered prompt); bad tool requests
are 400s."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from apitest_server import MODEL, assert_error
from apitest_streams import collect_async
from apitest_structured import STRUCTURED_SERVER, TEMPLATE_MARK
from apitest_structured import server, client  # noqa: F401  (fixtures)

SERVERS = {"structured": STRUCTURED_SERVER}
MAX_TOKENS = 120


def tool(name: str, description: str, parameters: dict | None) -> dict:
    function = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", "Current weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = tool("add", "Add two integers", {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False})
# References inside a tool's schema must still resolve once the server nests it in its grammar.
ROUTE = tool("route", "A route between two points", {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x", "y"], "additionalProperties": False}},
    "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
    "required": ["start", "end"], "additionalProperties": False})
NOW = tool("now", "The current time; takes no arguments", None)
TOOLS = [WEATHER, ADD, ROUTE, NOW]
# OpenAI: no parameters schema means an empty parameter list.
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "maxProperties": 0}
           for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MANY_ASK = [{"role": "user", "content": "Add 1 and 2, then add 3 and 4, then add 5 and 6."}]


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def calls_of(client, stream: bool, **kwargs) -> list[tuple[str | None, str, list[dict]]]:
    """``(content, finish_reason, [{"id", "type", "name", "arguments"}, ...])`` per choice."""
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": MAX_TOKENS, "tools": TOOLS, **kwargs}
    if stream:
        choices = await collect_async(await client.chat.completions.create(**kwargs, stream=True))
        return [(c.content or None, c.finish_reason, c.calls()) for _, c in sorted(choices.items())]
    out = await client.chat.completions.create(**kwargs)
    return [(c.message.content, c.finish_reason,
             [{"id": t.id, "type": t.type, "name": t.function.name, "arguments": t.function.arguments}
              for t in c.message.tool_calls or []])
            for c in sorted(out.choices, key=lambda c: c.index)]


def hermes_regex(n_calls: int) -> str:
    """Text a Hermes model would write: a sentence, then ``n_calls`` calls of ``add``."""
    call = r'\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>'
    return "Sure[.]" + call * n_calls


def _cases() -> dict:
    cases = {}
    for stream in (False, True):
        # A one-call question: asked for several things, the small model repeats calls until the limit.
        # The seed picks two samples that end after their calls (a seeded sample is a function of
        # the seed alone, whatever else runs beside it); other seeds may write calls to the limit.
        cases[("required", stream)] = dict(messages=WEATHER_ASK, tool_choice="required", n=2, temperature=0.7,
                                           seed=2)
        cases[("one call", stream)] = dict(messages=MANY_ASK, tool_choice="required", temperature=0,
                                           parallel_tool_calls=False)
        for name in SCHEMAS:
            cases[("named", name, stream)] = dict(tool_choice={"type": "function", "function": {"name": name}}, n=2,
                                                  temperature=0.7, seed=5)
        for parallel in (True, False):
            cases[("auto", parallel, stream)] = dict(
                tool_choice="auto", temperature=0, extra_body={"guided_regex": hermes_regex(2)},
                **({} if parallel else {"parallel_tool_calls": False}))
    cases[("auto text", False)] = dict(temperature=0, extra_body={"guided_regex": "No tools needed[.]"})
    return cases


@pytest.fixture(scope="module")
def runs(server):
    """Every generating case at once (they batch): ``{case: [(content, finish_reason, calls), ...]}``."""
    cases = _cases()

    async def run():
        client = server.async_client()
        try:
            results = await asyncio.gather(*(calls_of(client, key[-1], **kwargs) for key, kwargs in cases.items()))
        finally:
            await client.close()
        return dict(zip(cases, results))

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_validate(runs, stream):
    choices = runs[("required", stream)]
    assert len(choices) == 2
    for content, reason, calls in choices:
        assert reason == "tool_calls" and content is None
        assert calls
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            check_call(call["name"], call["arguments"])
        assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_named_function_arguments_validate(runs, stream, name):
    choices = runs[("named", name, stream)]
    assert len(choices) == 2
    for content, reason, calls in choices:
        assert reason == "tool_calls" and content is None
        assert [c["name"] for c in calls] == [name]
        check_call(name, calls[0]["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gives_one_call(runs, stream):
    [(_, reason, calls)] = runs[("one call", stream)]
    assert reason == "tool_calls" and len(calls) == 1
    check_call(calls[0]["name"], calls[0]["arguments"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_reads_calls_with_the_tool_call_parser(runs, stream, parallel):
    [(content, reason, calls)] = runs[("auto", parallel, stream)]
    assert content.strip() == "Sure."
    assert reason == "tool_calls"
    assert [c["name"] for c in calls] == (["add", "add"] if parallel else ["add"])
    for call in calls:
        args = json.loads(call["arguments"])
        assert set(args) == {"a", "b"} and all(1 <= v <= 9 for v in args.values())
        check_call("add", call["arguments"])


def test_auto_without_a_call_is_content(runs):
    assert runs[("auto text", False)] == [("No tools needed.", "stop", [])]


def tokenize(http, messages: list[dict], **fields) -> dict:
    resp = http.post("/tokenize", json={"model": MODEL, "messages": messages, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def detokenize(http, tokens: list[int]) -> str:
    resp = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert resp.status_code == 200, resp.text
    return resp.json()["prompt"]


def test_tools_reach_the_template(server, client):
    with server.http() as http:
        with_tools = tokenize(http, ASK, tools=TOOLS)
        without = tokenize(http, ASK)
        prompt = detokenize(http, with_tools["tokens"])
    assert TEMPLATE_MARK in prompt  # the --chat-template file, not SmolLM2's own
    for t in TOOLS:
        assert json.dumps(t) in prompt
    assert with_tools["count"] > without["count"]
    # tool_choice "none": the tools are still rendered, the reply is text.
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert out.usage.prompt_tokens == with_tools["count"]
    assert out.choices[0].message.tool_calls is None and isinstance(out.choices[0].message.content, str)


def test_a_tool_conversation_renders(server, client):
    call = {"id": "call_abc", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_abc", "content": "RESULT-FIVE"}]
    with server.http() as http:
        rendered = tokenize(http, turns, tools=TOOLS)
        prompt = detokenize(http, rendered["tokens"])
    assert '<tool_response id="call_abc">RESULT-FIVE</tool_response>' in prompt
    assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in prompt
    out = client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert out.usage.prompt_tokens == rendered["count"]


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD, ADD], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [tool("f", "", {"type": "string", "minLength": 3, "maxLength": 1})], "tool_choice": "required"},
     "tools"),
    ({"tools": [tool("f", "", {"type": "string", "minLength": 3, "maxLength": 1})],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"functions": [ADD["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tool_requests_are_400(server, fields, param):
    with server.http() as http:
        resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    assert_error(resp, 400, param)


def test_tool_call_ids_are_unique(runs):
    ids = [call["id"] for key, choices in runs.items() if key[0] in ("required", "named")
           for _, _, calls in choices for call in calls]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
