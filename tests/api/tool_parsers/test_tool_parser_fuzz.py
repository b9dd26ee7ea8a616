"""Generated outputs for every format, streamed in random splits.

Well-formed outputs (calls in the format, text around them where the format allows it) must
stream to exactly the non-streaming result. For any text at all, marker soup included, the
parsers never raise, and when no call was sent the streamed content is the whole output.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toolparser_harness import assert_same, random_deltas, stream

from deepbatch.api.tool_parsers import get_tool_parser

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

arg_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(alphabet='ab"\\{}[]<>|é東🚀\n ,:', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="abc", max_size=3), inner, max_size=3),
    max_leaves=6,
)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "f", "search_docs"]),
                           st.dictionaries(st.text(alphabet="xyz_", min_size=1, max_size=4), arg_values, max_size=3),
                           st.sampled_from([dict(), dict(ensure_ascii=False), dict(indent=2)])),
                 min_size=1, max_size=3)
texts = st.sampled_from(["", "", "Sure.", "Let me check <b>that</b>.\n", "a < b; c > d", "\n\n", " ", "東京 🚀"])


def render(fmt: str, before: str, after: str, cs) -> str:
    if fmt == "hermes":
        blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, **kw)}\n</tool_call>' for n, a, kw in cs]
        return before + "\n".join(blocks) + after
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, **kw) for n, a, kw in cs)
    if fmt == "deepseek_v3":
        body = "\n".join(f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a, **kw)}\n```{CALL_END}" for n, a, kw in cs)
    else:
        body = "".join(f"{CALL_BEGIN}{n}{SEP}{json.dumps(a, **kw)}{CALL_END}" for n, a, kw in cs)
    return before + CALLS_BEGIN + body + CALLS_END + after


FORMATS = ["hermes", "llama3_json", "deepseek_v3", "deepseek_v31"]


@SETTINGS
@given(fmt=st.sampled_from(FORMATS), before=texts, after=texts, cs=calls, seed=st.integers(0, 10**6),
       max_len=st.sampled_from([1, 2, 4, 16]))
def test_well_formed_outputs_stream_to_the_same_calls(fmt, before, after, cs, seed, max_len):
    output = render(fmt, before, after, cs)
    parser = get_tool_parser(fmt)
    extracted = parser(None).extract_tool_calls(output)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == [(n, a) for n, a, _ in cs]
    assert_same(stream(parser(None), random_deltas(output, seed, max_len)), extracted)


SOUP = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", '{"name": "f", "arguments": {"a": 1}}', '{"name": "g"',
               ', "arguments": {', "}", "{", '"', "\n", " ", "text", "<"],
    "llama3_json": ["<|python_tag|>", "<|python", '{"name": "f", "parameters": {"a": [1]}}', '{"name": "g"',
                    ', "parameters": {', "}", ";", "{", '"', "\n", " ", "text"],
    "deepseek_v3": [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "function", "f", "\n", "```json", "```",
                    '{"a": 1}', "{", "}", " ", "text", "<｜"],
    "deepseek_v31": [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, "f", "\n", '{"a": 1}', "{", "}", " ", "text",
                     "<｜tool"],
}


@SETTINGS
@given(data=st.data(), fmt=st.sampled_from(FORMATS), seed=st.integers(0, 10**6), max_len=st.sampled_from([1, 3, 50]))
def test_any_text_streams_without_loss(data, fmt, seed, max_len):
    output = "".join(data.draw(st.lists(st.sampled_from(SOUP[fmt]), max_size=14)))
    parser = get_tool_parser(fmt)
    extracted = parser(None).extract_tool_calls(output)
    streamed = stream(parser(None), random_deltas(output, seed, max_len))
    if not streamed.calls:
        assert streamed.content == output
        assert not extracted.tools_called
    if extracted.tools_called:
        assert_same(streamed, extracted)
