"""deepseek_v3 and deepseek_v31: DeepSeek's tool-call special tokens, whole and streamed.

The markers are spelled out here, not imported, so a wrong character in the parser's copy
fails these tests: U+FF5C FULLWIDTH VERTICAL LINE and U+2581 LOWER ONE EIGHTH BLOCK.
"""

from __future__ import annotations

import pytest
from toolparser_harness import call_tuples, check_all_splits, splits, stream

from deepbatch.api.tool_parsers import get_tool_parser

V3 = get_tool_parser("deepseek_v3")
V31 = get_tool_parser("deepseek_v31")

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"


def v3_call(name: str, args: str) -> str:
    """One call as DeepSeek-V3's and R1's chat templates write it."""
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


NESTED_ARGS = (
    '{\n  "query": "caf\\u00e9 \\"cr\\u00e8me\\" 東京",\n  "filters": {"tags": ["🚀", "a\\\\b", "```"], '
    '"range": [1, 2.5, -3e-2], "strict": false, "lang": null}\n}'
)
NESTED = {"query": 'café "crème" 東京', "filters": {"tags": ["🚀", "a\\b", "```"], "range": [1, 2.5, -0.03],
                                                   "strict": False, "lang": None}}

V3_VALID = {
    "one": (CALLS_BEGIN + v3_call("get_weather", '{"location": "Hangzhou"}') + CALLS_END,
            [("get_weather", {"location": "Hangzhou"})], None),
    "several": (CALLS_BEGIN + v3_call("get_weather", '{"location": "Hangzhou"}') + "\n"
                + v3_call("get_weather", '{"location": "Beijing", "unit": "celsius"}') + CALLS_END,
                [("get_weather", {"location": "Hangzhou"}), ("get_weather", {"location": "Beijing", "unit": "celsius"})],
                None),
    "content_before": ("I will check the weather in Hangzhou." + CALLS_BEGIN
                       + v3_call("get_weather", '{"location": "Hangzhou"}') + CALLS_END,
                       [("get_weather", {"location": "Hangzhou"})], "I will check the weather in Hangzhou."),
    "nested_unicode_escapes_pretty": (f'{CALLS_BEGIN}{v3_call("search", NESTED_ARGS)}{CALLS_END}',
                                      [("search", NESTED)], None),
    # Cut at the end-of-sentence token right after the last call.
    "no_calls_end": (f'{CALLS_BEGIN}{v3_call("get_time", "{}")}', [("get_time", {})], None),
    "no_call": ("DeepSeek writes <｜ and ```json in plain text too.", [],
                "DeepSeek writes <｜ and ```json in plain text too."),
}

V3_MALFORMED = {
    "no_fence": f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n{{"location": "Hangzhou"}}\n{CALL_END}{CALLS_END}',
    "python_dict": CALLS_BEGIN + v3_call("get_weather", "{'location': 'Hangzhou'}"),
    "no_type": f'{CALLS_BEGIN}{CALL_BEGIN}{SEP}get_weather\n```json\n{{}}\n```{CALL_END}{CALLS_END}',
    "empty_section": f"Hmm.{CALLS_BEGIN}{CALLS_END}",
    "text_before_the_first_call": CALLS_BEGIN + "sure\n" + v3_call("a", "{}") + CALLS_END,
    "cut_off_in_name": f"\n{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_wea",
    "arguments_not_object": f'{CALLS_BEGIN}{v3_call("f", "[1, 2]")}{CALLS_END}',
}

V31_VALID = {
    "one": (CALLS_BEGIN + v31_call("get_weather", '{"location": "Hangzhou"}') + CALLS_END,
            [("get_weather", {"location": "Hangzhou"})], None),
    "several": (CALLS_BEGIN + v31_call("get_weather", '{"location": "Hangzhou"}')
                + v31_call("get_time", '{"tz": "Asia/Shanghai"}') + CALLS_END,
                [("get_weather", {"location": "Hangzhou"}), ("get_time", {"tz": "Asia/Shanghai"})], None),
    "content_before": ("Let me look." + CALLS_BEGIN + v31_call("get_weather", '{"location": "Hangzhou"}') + CALLS_END,
                       [("get_weather", {"location": "Hangzhou"})], "Let me look."),
    "nested_unicode_escapes": (f'{CALLS_BEGIN}{v31_call("search", NESTED_ARGS)}{CALLS_END}', [("search", NESTED)], None),
}

V31_MALFORMED = {
    "newline_in_name": f'{CALLS_BEGIN}{CALL_BEGIN}get\nweather{SEP}{{}}{CALL_END}{CALLS_END}',
    "v3_form": f'{CALLS_BEGIN}{v3_call("get_weather", "{}")}{CALLS_END}',
    "no_sep": f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_END}{CALLS_END}',
    "python_dict": CALLS_BEGIN + v31_call("f", "{'a': 1}") + CALLS_END,
}

CASES = [(V3, k, *v) for k, v in V3_VALID.items()] + [(V31, k, *v) for k, v in V31_VALID.items()]
MALFORMED = [(V3, k, v) for k, v in V3_MALFORMED.items()] + [(V31, k, v) for k, v in V31_MALFORMED.items()]


def _ids(cases):
    return [f"{c[0].__name__}-{c[1]}" for c in cases]


@pytest.mark.parametrize("parser,case,output,calls,content", CASES, ids=_ids(CASES))
def test_extract(parser, case, output, calls, content):
    result = parser(None).extract_tool_calls(output)
    assert result.tools_called == bool(calls)
    assert call_tuples(result) == calls
    assert result.content == content


@pytest.mark.parametrize("parser,case,output,calls,content", CASES, ids=_ids(CASES))
def test_streaming_matches_extract(parser, case, output, calls, content, marker_tokenizer):
    check_all_splits(parser, output, marker_tokenizer)


@pytest.mark.parametrize("parser,case,output", MALFORMED, ids=_ids(MALFORMED))
def test_malformed_is_content(parser, case, output, marker_tokenizer):
    result = parser(None).extract_tool_calls(output)
    assert (result.tools_called, result.tool_calls, result.content) == (False, [], output)
    check_all_splits(parser, output, marker_tokenizer)


def test_markers_are_single_tokens_in_the_stream(marker_tokenizer):
    output = V3_VALID["several"][0]
    pieces = splits(output, marker_tokenizer)["per_token"]
    for marker in (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END):
        assert marker in pieces


@pytest.mark.parametrize("parser", [V3, V31])
def test_arguments_are_returned_as_written(parser):
    make = v3_call if parser is V3 else v31_call
    output = f"{CALLS_BEGIN}{make('search', NESTED_ARGS)}{CALLS_END}"
    (call,) = parser(None).extract_tool_calls(output).tool_calls
    assert call.arguments == NESTED_ARGS
    assert stream(parser(None), list(output)).calls[0].arguments == NESTED_ARGS


def test_malformed_after_the_call_was_sent():
    # The JSON breaks at the trailing comma: the call and its arguments up to there were sent.
    output = CALLS_BEGIN + v3_call("get_weather", '{"location": "Hangzhou",}') + CALLS_END
    assert V3(None).extract_tool_calls(output).content == output
    streamed = stream(V3(None), list(output))
    assert [(c.name, c.arguments) for c in streamed.calls] == [("get_weather", '{"location": "Hangzhou",')]
    assert streamed.content == f"}}\n```{CALL_END}{CALLS_END}"


def test_missing_closing_fence_after_the_call_was_sent():
    output = f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{"a": 1}}\n{CALL_END}{CALLS_END}'
    assert V3(None).extract_tool_calls(output).content == output
    streamed = stream(V3(None), list(output))
    assert [(c.name, c.arguments) for c in streamed.calls] == [("f", '{"a": 1}')]
    assert streamed.content == f"{CALL_END}{CALLS_END}"


def test_text_between_calls_after_the_first_was_sent():
    output = CALLS_BEGIN + v3_call("a", "{}") + "\nand then\n" + v3_call("b", "{}") + CALLS_END
    assert V3(None).extract_tool_calls(output).content == output
    for pieces in (list(output), [output]):
        streamed = stream(V3(None), pieces)
        assert [(c.name, c.arguments) for c in streamed.calls] == [("a", "{}")]
        assert streamed.content == "\nand then\n" + v3_call("b", "{}") + CALLS_END
