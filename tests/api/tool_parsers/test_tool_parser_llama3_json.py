"""llama3_json: Llama 3.x JSON tool calls, whole and streamed."""

from __future__ import annotations

import json

import pytest
from toolparser_harness import call_tuples, check_all_splits, stream

from deepbatch.api.tool_parsers import get_tool_parser

Parser = get_tool_parser("llama3_json")
TAG = "<|python_tag|>"

NESTED_PARAMS = (
    r'{"query": "caf\u00e9 \"cr\u00e8me\" 東京", "filters": {"tags": ["🚀", "a\\b", "; {"], '
    r'"range": [1, 2.5, -3e-2], "strict": false, "lang": null}}'
)
NESTED = {"query": 'café "crème" 東京', "filters": {"tags": ["🚀", "a\\b", "; {"], "range": [1, 2.5, -0.03],
                                                   "strict": False, "lang": None}}

VALID = {
    "one": ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
            [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})], None),
    "python_tag": (TAG + '{"name": "get_current_conditions", "parameters": {"location": "Paris"}}',
                   [("get_current_conditions", {"location": "Paris"})], None),
    "several": (('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'),
                [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})], None),
    "several_with_tag": (TAG + '{"name": "a", "parameters": {}};{"name": "b", "parameters": {"x": 1}}\n',
                         [("a", {}), ("b", {"x": 1})], None),
    # Llama 3.2 often adds the type.
    "type_key": ('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
                 [("get_weather", {"city": "Paris"})], None),
    "arguments_key": ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})], None),
    "nested_unicode_escapes": ('{"name": "search", "parameters": ' + NESTED_PARAMS + "}", [("search", NESTED)], None),
    "leading_whitespace": ('\n\n {"name": "f", "parameters": {}}', [("f", {})], None),
    "plain_answer": ("The weather in Paris is sunny; 22 degrees.", [], "The weather in Paris is sunny; 22 degrees."),
    # A JSON answer (response in JSON, no tool) is content, even one with a "name".
    "json_answer": ('{"answer": 42}', [], '{"answer": 42}'),
    "json_answer_with_name": ('{"name": "Bob", "age": 31}', [], '{"name": "Bob", "age": 31}'),
    # Text before the JSON: the format has no place for content, so it is all content.
    "content_before": ('Sure! {"name": "f", "parameters": {}}', [], 'Sure! {"name": "f", "parameters": {}}'),
    "partial_tag_text": ("<|python", [], "<|python"),
}

MALFORMED = {
    "python_code": TAG + 'brave_search.call(query="weather Paris")',
    "single_quotes": "{'name': 'get_weather', 'parameters': {'city': 'Paris'}}",
    "python_dict_parameters": "{\"name\": \"get_weather\", \"parameters\": {'city': 'Paris'}}",
    "parameters_not_object": '{"name": "get_weather", "parameters": "Paris"}',
    "cut_off_before_parameters": '{"name": "get_weather", "param',
    "only_tag": TAG,
}


@pytest.mark.parametrize("case", VALID)
def test_extract(case):
    output, calls, content = VALID[case]
    result = Parser(None).extract_tool_calls(output)
    assert result.tools_called == bool(calls)
    assert call_tuples(result) == calls
    assert result.content == content


@pytest.mark.parametrize("case", VALID)
def test_streaming_matches_extract(case, marker_tokenizer):
    check_all_splits(Parser, VALID[case][0], marker_tokenizer)


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_is_content(case, marker_tokenizer):
    output = MALFORMED[case]
    result = Parser(None).extract_tool_calls(output)
    assert (result.tools_called, result.tool_calls, result.content) == (False, [], output)
    check_all_splits(Parser, output, marker_tokenizer)


def test_arguments_are_reserialised_from_parameters():
    (call,) = Parser(None).extract_tool_calls('{"name":"f","parameters":{"a" :  [1,2],"b":"é"}}').tool_calls
    assert call.arguments == json.dumps({"a": [1, 2], "b": "é"}, ensure_ascii=False)


def test_malformed_after_the_call_was_sent():
    output = '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI hope that helps.'
    assert Parser(None).extract_tool_calls(output).content == output
    streamed = stream(Parser(None), list(output))
    assert [(c.name, c.arguments) for c in streamed.calls] == [("get_weather", '{"city": "Paris"}')]
    assert streamed.content == "\nI hope that helps."
