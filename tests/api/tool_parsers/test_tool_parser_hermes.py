"""hermes: Qwen2.5/Qwen3/Hermes ``<tool_call>`` blocks, whole and streamed."""

from __future__ import annotations

import json

import pytest
from toolparser_harness import ID_RE, call_tuples, check_all_splits, splits, stream

from deepbatch.api.tool_parsers import get_tool_parser

Parser = get_tool_parser("hermes")

WEATHER = '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
NESTED_ARGS = (
    r'{"query": "caf\u00e9 \"cr\u00e8me br\u00fbl\u00e9e\" 東京", "filters": {"year": {"gte": 2019, "lte": 2024}, '
    r'"tags": ["é", "🚀", "a\\b", "}{]["], "exact": true, "lang": null}, "limit": 1.5e1, "offset": -0}'
)

# (output as the model writes it, expected calls, expected content)
VALID = {
    "one": (f"<tool_call>\n{WEATHER}\n</tool_call>",
            [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})], None),
    "several": (
        ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
         '"date": "2024-10-01", "unit": "celsius"}}\n</tool_call>'),
        [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
         ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"})],
        None),
    "content_before": (
        f"To answer that I need the current weather first.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
        [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})],
        "To answer that I need the current weather first.\n\n"),
    "nested_unicode_escapes": (
        f'<tool_call>\n{{"name": "search_documents", "arguments": {NESTED_ARGS}}}\n</tool_call>',
        [("search_documents", {"query": 'café "crème brûlée" 東京',
                               "filters": {"year": {"gte": 2019, "lte": 2024}, "tags": ["é", "🚀", "a\\b", "}{]["],
                                           "exact": True, "lang": None},
                               "limit": 15.0, "offset": 0})],
        None),
    # Qwen3 after its thinking: the whitespace before the call is not content.
    "whitespace_before": ('\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', [("get_time", {})], None),
    "arguments_first": ('<tool_call>\n{"arguments": {"code": "print(1 < 2)"}, "name": "python"}\n</tool_call>',
                        [("python", {"code": "print(1 < 2)"})], None),
    "tag_inside_argument": ('<tool_call>\n{"name": "echo", "arguments": {"text": "</tool_call><tool_call>"}}\n</tool_call>',
                            [("echo", {"text": "</tool_call><tool_call>"})], None),
    "content_after": (f"<tool_call>\n{WEATHER}\n</tool_call>\nI'll report back with the forecast.",
                      [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})],
                      "\nI'll report back with the forecast."),
    # The output stopped on a "</tool_call>" stop string.
    "no_closing_tag": (f"<tool_call>\n{WEATHER}", [("get_current_weather", {"location": "San Francisco, CA",
                                                                             "unit": "fahrenheit"})], None),
    "parameters_key": ('<tool_call>\n{"name": "f", "parameters": {"x": [1, 2]}}\n</tool_call>', [("f", {"x": [1, 2]})], None),
    "no_call": ("The capital of France is Paris. In HTML, <tool_ and <b> are just text.\n", [],
                "The capital of France is Paris. In HTML, <tool_ and <b> are just text.\n"),
    "ends_in_partial_tag": ("Compare a <tool", [], "Compare a <tool"),
    "only_whitespace": ("\n\n", [], "\n\n"),
}

# Malformed before any call could be sent: streamed, it is the same all-content result.
MALFORMED = {
    "python_call": '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
    "single_quotes": "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
    "python_dict_arguments": "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {'city': 'Paris'}}\n</tool_call>",
    "no_arguments": '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    "arguments_as_string": '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
    "name_not_string": '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
    "empty_name": '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
    "raw_newline_in_string": '<tool_call>\n{"name": "get\nweather", "arguments": {}}\n</tool_call>',
    "cut_off_before_arguments": '\n<tool_call>\n{"name": "get_weath',
    "empty_block": "<tool_call>\n</tool_call>",
}


@pytest.mark.parametrize("case", VALID)
def test_extract(case):
    output, calls, content = VALID[case]
    result = Parser(None).extract_tool_calls(output)
    assert result.tools_called == bool(calls)
    assert call_tuples(result) == calls
    assert result.content == content
    assert all(ID_RE.fullmatch(c.id) for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == len(calls)


@pytest.mark.parametrize("case", VALID)
def test_streaming_matches_extract(case, marker_tokenizer):
    check_all_splits(Parser, VALID[case][0], marker_tokenizer)


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_is_content(case, marker_tokenizer):
    output = MALFORMED[case]
    result = Parser(None).extract_tool_calls(output)
    assert (result.tools_called, result.tool_calls, result.content) == (False, [], output)
    check_all_splits(Parser, output, marker_tokenizer)


def test_arguments_reserialised_without_ascii_escapes():
    (call,) = Parser(None).extract_tool_calls(VALID["nested_unicode_escapes"][0]).tool_calls
    assert "東京" in call.arguments and "crème" in call.arguments and "\\u" not in call.arguments


def test_streamed_arguments_are_the_models_own_text():
    streamed = stream(Parser(None), list(VALID["nested_unicode_escapes"][0]))
    assert streamed.calls[0].arguments == NESTED_ARGS


def test_name_sent_once_before_arguments():
    streamed = stream(Parser(None), list(VALID["several"][0]))
    firsts = [f for d in streamed.deltas for f in d.tool_calls if f.name is not None]
    assert [(f.index, f.name) for f in firsts] == [(0, "get_current_temperature"), (1, "get_temperature_date")]


def test_content_is_sent_before_the_call_completes():
    output = VALID["content_before"][0]
    parser = Parser(None)
    cut = output.index("<tool_call>") + len('<tool_call>\n{"name": "get_current_weather", "arguments": {"loc')
    delta = parser.extract_tool_calls_streaming("", output[:cut], output[:cut])
    assert delta.content == "To answer that I need the current weather first.\n\n"
    assert delta.tool_calls[0].name == "get_current_weather"
    assert delta.tool_calls[0].arguments == '{"loc'


def test_partial_tag_is_held_then_released():
    parser = Parser(None)
    assert parser.extract_tool_calls_streaming("", "a <tool", "a <tool").content == "a "
    assert parser.extract_tool_calls_streaming("a <tool", "a <tool box", " box").content == "<tool box"


# Malformed only after the call went out: what was sent stays; the text from where the JSON
# broke follows as content. A split that delivers the whole block at once sees the break before
# sending anything and gives the non-streaming result.
AFTER_SENT = {
    "missing_closing_brace": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        [("get_weather", '{"city": "Paris"}')], "</tool_call>"),
    "trailing_comma": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
        [("get_weather", '{"city": "Paris",')], "}}\n</tool_call>"),
    "nan": ('<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>', [("f", '{"x": ')],
            "NaN}}\n</tool_call>"),
    "cut_off_in_arguments": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                             [("get_weather", '{"city": "Par')], ""),
    "second_call_malformed": (
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>",
        [("get_current_weather", json.dumps({"location": "San Francisco, CA", "unit": "fahrenheit"}))],
        "\n<tool_call>\nnot json\n</tool_call>"),
}


@pytest.mark.parametrize("case", AFTER_SENT)
def test_malformed_after_the_call_was_sent(case, marker_tokenizer):
    output, sent_calls, sent_content = AFTER_SENT[case]
    whole = Parser(None).extract_tool_calls(output)
    assert (whole.tools_called, whole.content) == (False, output)
    for name, pieces in splits(output, marker_tokenizer).items():
        streamed = stream(Parser(None), pieces)
        got = ([(c.name, c.arguments) for c in streamed.calls], streamed.content)
        if name == "per_char":
            assert got == (sent_calls, sent_content)
        else:
            assert got in ((sent_calls, sent_content), ([], output)), name
