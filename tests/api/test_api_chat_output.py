"""The chat reply's parsing pieces without a server: the scanner that reads tool calls out of the
JSON of ``tool_choice="required"``, the grammar's schema built from the tools (checked with
``jsonschema`` and compiled with xgrammar), ``ChoiceParser`` streaming the same reasoning,
content and calls as it returns whole, and the start-up checks of ``--chat-template``,
``--tool-call-parser``, ``--enable-auto-tool-choice`` and ``--reasoning-parser``."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from deepbatch.api.chat_output import ChoiceParser, ParserConfig, load_parsers, reasoning_open, strip_eos
from deepbatch.api.chat_template import load_chat_template
from deepbatch.api.errors import APIError
from deepbatch.api.protocol import ChatCompletionRequest
from deepbatch.api.reasoning import get_reasoning_parser
from deepbatch.api.serving_tools import plan_tools
from deepbatch.api.tool_call_json import ToolCallArrayScanner
from deepbatch.api.tool_parsers import get_tool_parser
from deepbatch.core.outputs import CompletionOutput

ARRAYS = [
    '[{"name": "add", "parameters": {"a": 1, "b": 2}}]',
    '[ {"name":"add","parameters":{"a":1,"b":2}} , {"name": "get", "parameters": {"s": "}{,\\"]["}} ]',
    '[\n  {\n    "parameters": {"x": [1, {"y": null}]},\n    "name": "swapped"\n  }\n]',
    '[{"name": "esc\\"aped", "parameters": "a string"}, {"name": "n", "parameters": 12.5e3}]',
    '[{"name": "t", "parameters": true}, {"name": "e", "parameters": {}}]',
]


def scan(text: str, chunks: list[int] | None = None) -> ToolCallArrayScanner:
    scanner = ToolCallArrayScanner()
    if chunks is None:
        scanner.feed(text)
        return scanner
    pos = 0
    for size in chunks:
        scanner.feed(text[pos:pos + size])
        pos += size
    scanner.feed(text[pos:])
    return scanner


@pytest.mark.parametrize("text", ARRAYS)
def test_scanner_reads_the_calls_whole_and_in_pieces(text):
    expected = [(item["name"], item["parameters"]) for item in json.loads(text)]
    rng = random.Random(text)
    for chunks in (None, [1] * len(text), [rng.randint(1, 5) for _ in range(len(text))]):
        scanner = scan(text, chunks)
        got = [(c.name, json.loads(scanner.arguments(c))) for c in scanner.calls]
        assert got == expected


def test_scanner_hands_out_arguments_as_they_grow():
    text = ARRAYS[1]
    scanner = ToolCallArrayScanner()
    seen: dict[int, str] = {}
    for ch in text:
        scanner.feed(ch)
        for i, call in enumerate(scanner.calls):
            now = scanner.arguments(call)
            assert now.startswith(seen.get(i, ""))  # never takes back what was handed out
            seen[i] = now
    assert [json.loads(seen[i]) for i in sorted(seen)] == [item["parameters"] for item in json.loads(text)]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
ROUTE = {"name": "route", "parameters": {
    "$defs": {"point": POINT}, "type": "object",
    "properties": {"start": {"$ref": "#/$defs/point"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["start", "next"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
NOW = {"name": "now"}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_accepts_exactly_the_tools_calls(parallel):
    tools = [{"type": "function", "function": f} for f in (ROUTE, ADD, NOW)]
    plan = plan_tools(_request(tools=tools, tool_choice="required", parallel_tool_calls=parallel), auto_tools=False)
    schema = plan.constraint.kwargs["json"]
    route = {"start": {"x": 1}, "next": {"start": {"x": 2}, "next": None}}
    ok = [{"name": "route", "parameters": route}, {"name": "add", "parameters": {"a": 3}},
          {"name": "now", "parameters": {}}]
    for item in ok:
        jsonschema.validate([item], schema)
    bad = [[], [{"name": "add", "parameters": {"a": "3"}}], [{"name": "nope", "parameters": {}}],
           [{"name": "now", "parameters": {"extra": 1}}], [{"name": "route", "parameters": {**route, "start": {}}}],
           [{"name": "add"}]]
    if not parallel:
        bad.append(ok[1:])
    for instance in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)
    if parallel:
        jsonschema.validate(ok, schema)
    import xgrammar

    xgrammar.Grammar.from_json_schema(json.dumps(schema))


def test_named_schema_is_the_functions_parameters():
    tools = [{"type": "function", "function": f} for f in (ADD, NOW)]
    named = plan_tools(_request(tools=tools, tool_choice={"type": "function", "function": {"name": "add"}}), False)
    assert named.constraint.kwargs["json"] == ADD["parameters"] and named.function == "add"
    empty = plan_tools(_request(tools=tools, tool_choice={"type": "function", "function": {"name": "now"}}), False)
    jsonschema.validate({}, empty.constraint.kwargs["json"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1}, empty.constraint.kwargs["json"])


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},
    {"tools": [{"type": "function", "function": ADD}]},  # "auto" by default, without the server flags
    {"tools": [{"type": "function", "function": ADD}], "tool_choice": {"type": "function", "function": {"name": "x"}}},
    {"tools": [{"type": "function", "function": ADD}] * 2, "tool_choice": "required"},
])
def test_tool_plans_refused(fields):
    with pytest.raises(APIError) as e:
        plan_tools(_request(**fields), auto_tools=False)
    assert e.value.status == 400 and e.value.param in ("tool_choice", "tools")


class _Vocab:
    """The part of a ``tokenizers.Tokenizer`` the parsers read."""

    def __init__(self, tokens):
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self):
        return dict(self.vocab)

    def token_to_id(self, token):
        return self.vocab.get(token)


TOKENIZER = _Vocab(["<think>", "</think>", "<tool_call>", "</tool_call>"])
REASONING_OUTPUTS = [
    "<think>Let me see. 2 + 2 = 4</think>The answer is 4.",
    "<think>cut off while thinking",
    "<think>ok</think>Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
    '<think>calling</think>[{"name": "add", "parameters": {"a": 1}}, {"name": "now", "parameters": {}}]',
    '<think>x</think>{"a": 5}',
]


def _stream(parser: ChoiceParser, text: str, rng: random.Random) -> dict:
    got = {"reasoning": "", "content": "", "calls": {}}
    pos = 0
    while pos < len(text):
        size = rng.randint(1, 4)
        final = pos + size >= len(text)
        delta = parser.delta(text[pos:pos + size], final=final)
        pos += size
        if delta is None:
            continue
        got["reasoning"] += delta.reasoning_content or ""
        got["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            entry = got["calls"].setdefault(call.index, {"name": None, "arguments": ""})
            if call.function is not None:
                entry["name"] = entry["name"] or call.function.name
                entry["arguments"] += call.function.arguments or ""
    return got


@pytest.mark.parametrize("mode", ["none", "auto", "required", "named"])
@pytest.mark.parametrize("text", REASONING_OUTPUTS)
def test_choice_parser_streams_what_it_returns_whole(mode, text):
    tools = [{"type": "function", "function": f} for f in (ADD, NOW)]
    choice = {"none": "none", "auto": "auto", "required": "required",
              "named": {"type": "function", "function": {"name": "add"}}}[mode]
    plan = plan_tools(_request(tools=tools, tool_choice=choice), auto_tools=True)
    config = ParserConfig(tool_parser=get_tool_parser("hermes"), reasoning_parser=get_reasoning_parser("qwen3"))
    whole = ChoiceParser(plan, config, TOKENIZER).parse(text)
    for seed in range(3):
        got = _stream(ChoiceParser(plan, config, TOKENIZER), text, random.Random(seed))
        assert got["reasoning"] == (whole.reasoning or "")
        assert got["content"] == (whole.content or "")
        calls = [got["calls"][i] for i in sorted(got["calls"])]
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                                for c in whole.tool_calls]
    if mode == "named" and text.endswith("}"):
        assert json.loads(whole.tool_calls[0].function.arguments) == json.loads(text.split("</think>")[1])


def test_finish_reason_is_tool_calls_only_after_calls():
    plan = plan_tools(_request(tools=[{"type": "function", "function": ADD}], tool_choice="required"), False)
    parser = ChoiceParser(plan, ParserConfig(), TOKENIZER)
    assert parser.finish_reason("stop") == "stop"
    parser.parse('[{"name": "add", "parameters": {"a": 1}}]')
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


def test_strip_eos_and_reasoning_open():
    def text_of(t):
        return {7: "<|im_end|>", 8: "x"}[t]

    done = CompletionOutput(0, "abc<|im_end|>", [8, 7], "stop")
    assert strip_eos(done, {7}, text_of).text == "abc"
    for kept in (CompletionOutput(0, "abc<|im_end|>", [8, 7], "length"),  # not ended by the EOS
                 CompletionOutput(0, "abc<|im_end|>", [8, 7], "stop", stop_reason=7),  # a stop token id
                 CompletionOutput(0, "abcx", [8, 8], "stop")):
        assert strip_eos(kept, {7}, text_of).text == kept.text

    def decode(ids):
        return "".join({1: "<think>", 2: "</think>", 3: "\n\n", 4: "hi"}[t] for t in ids)

    assert reasoning_open([4, 1], 2, decode)  # the template opened the thinking
    assert reasoning_open([4], 2, decode)  # the model will open it
    assert not reasoning_open([4, 1, 2, 3], 2, decode)  # closed empty by the template: no thinking
    assert reasoning_open([1, 2, 4, 4], 2, decode)  # an earlier turn's thinking, then a new turn


def test_parsers_refuse_a_tokenizer_without_their_markers():
    with pytest.raises(ValueError, match="--reasoning-parser"):
        load_parsers(None, "qwen3", False, _Vocab(["<tool_call>"]))
    with pytest.raises(ValueError, match="--tool-call-parser"):
        load_parsers(None, None, True, TOKENIZER)
    with pytest.raises(ValueError, match="unknown"):
        load_parsers("no-such-parser", None, True, TOKENIZER)
    config = load_parsers("hermes", "deepseek_r1", False, TOKENIZER)
    assert config.tool_parser is None and config.reasoning_parser is not None  # no auto: the parser is idle


def test_chat_template_from_a_file_or_inline(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}")


@pytest.mark.parametrize("flags,message", [
    (["--chat-template", "/no/such/template.jinja"], "neither a file nor"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "unknown tool call parser"),
    (["--reasoning-parser", "nope"], "unknown reasoning parser"),
    (["--replicas", "2", "--reasoning-parser", "qwen3"], "not available with --replicas"),
])
def test_serve_flags_fail_before_the_model_loads(capsys, flags, message):
    from deepbatch.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--device", "cpu", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_delta_that_crosses_the_end_of_the_reasoning_goes_out_as_two():
    # Several tokens can reach one chunk (the engine core's per-step messages coalesce while the
    # client is slow); the reasoning part still goes out alone, first.
    from deepbatch.api.protocol import ChatStreamChoice, DeltaMessage
    from deepbatch.api.responses import split_reasoning

    both = ChatStreamChoice(index=1, delta=DeltaMessage(reasoning_content=" carefully.", content="The answer"),
                            finish_reason="stop")
    head, rest = split_reasoning(both)
    assert head.index == rest.index == 1 and head.finish_reason is None and rest.finish_reason == "stop"
    assert (head.delta.reasoning_content, head.delta.content) == (" carefully.", None)
    assert (rest.delta.reasoning_content, rest.delta.content) == (None, "The answer")
    plain = ChatStreamChoice(index=0, delta=DeltaMessage(reasoning_content="hmm"))
    assert split_reasoning(plain) == (None, plain)
