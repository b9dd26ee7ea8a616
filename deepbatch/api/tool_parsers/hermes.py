"""Hermes-style tool calls, as Qwen2.5, Qwen3 and the Hermes models write them.

The model emits each call as one JSON object between tags, any number of them, usually after
some text:

    I'll check both cities.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Tokyo"}}
    </tool_call>

``<tool_call>`` and ``</tool_call>`` are added tokens of the Qwen tokenizers. A call may also
carry its arguments under ``"parameters"``; the arguments must be an object. The last call may
lack its closing tag when the output ends right after its JSON (a stop string on the tag).
"""

from __future__ import annotations

from deepbatch.api.parser_types import ExtractedToolCalls, ToolCall
from deepbatch.api.tool_parsers.base import (
    JsonObjectCallStream,
    Malformed,
    ToolParser,
    join_outside,
    match_literal,
    no_tool_calls,
    partial_marker_len,
    skip_whitespace,
    tool_call_from_object,
)
from deepbatch.api.tool_parsers.json_stream import raw_decode_strict

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARGS_KEYS = ("arguments", "parameters")


class Hermes2ProToolParser(ToolParser):
    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._call: JsonObjectCallStream | None = None
        self._index: int | None = None
        self._after_call = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if TOOL_CALL_START not in model_output:
            return no_tool_calls(model_output)
        calls: list[ToolCall] = []
        outside: list[str] = []
        pos = 0
        try:
            while True:
                start = model_output.find(TOOL_CALL_START, pos)
                if start < 0:
                    outside.append(model_output[pos:])
                    break
                outside.append(model_output[pos:start])
                obj, pos = raw_decode_strict(model_output, skip_whitespace(model_output, start + len(TOOL_CALL_START)))
                calls.append(tool_call_from_object(obj, ARGS_KEYS))
                pos = skip_whitespace(model_output, pos)
                if model_output.startswith(TOOL_CALL_END, pos):
                    pos += len(TOOL_CALL_END)
                elif pos < len(model_output):
                    raise Malformed(f"text after a tool call's JSON at {pos}")
        except (ValueError, RecursionError):
            return no_tool_calls(model_output)
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=join_outside(outside))

    def _advance(self, final: bool) -> None:
        text = self._text
        while not self._content_only:
            if self._after_call:
                at = skip_whitespace(text, self._pos)
                if at == len(text) and final:
                    self._after_call = False
                    self._outside_ended()
                    return
                found = match_literal(text, at, TOOL_CALL_END, final)
                if found == 0:
                    return
                if found < 0:
                    self._malformed(at, call_started=True)
                    return
                self._pos = at + len(TOOL_CALL_END)
                self._after_call = False
            elif self._call is None:
                start = text.find(TOOL_CALL_START, self._pos)
                if start < 0:
                    hold = 0 if final else partial_marker_len(text, self._pos, (TOOL_CALL_START,))
                    self._outside(len(text) - hold)
                    if final:
                        self._outside_ended()
                    return
                self._outside(start)
                self._open_call(start)
                self._pos = start + len(TOOL_CALL_START)
                self._call = JsonObjectCallStream(self._pos, ARGS_KEYS)
                self._index = None
            else:
                if not self._feed_json_call(self._call, text, final):
                    return
                self._call = None
                self._after_call = True
