"""Llama 3.1/3.2/3.3 JSON tool calls (the JSON-based tool calling of their chat templates).

The whole output is the calls: JSON objects with the arguments under ``"parameters"`` (or
``"arguments"``), several separated by ``;``, optionally after the ``<|python_tag|>`` special
token (decode with special tokens kept):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

Any other output, a JSON answer without a name and parameters included, is content. The
arguments are re-serialised from ``parameters``.
"""

from __future__ import annotations

from deepbatch.api.parser_types import ExtractedToolCalls, ToolCall
from deepbatch.api.tool_parsers.base import (
    JsonObjectCallStream,
    Malformed,
    ToolParser,
    match_literal,
    no_tool_calls,
    skip_whitespace,
    tool_call_from_object,
)
from deepbatch.api.tool_parsers.json_stream import raw_decode_strict

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")
SEPARATOR = ";"

_START, _CALL, _AFTER = range(3)


class Llama3JsonToolParser(ToolParser):
    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._state = _START
        self._call: JsonObjectCallStream | None = None
        self._index: int | None = None

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        out = model_output
        pos = skip_whitespace(out, 0)
        if out.startswith(PYTHON_TAG, pos):
            pos = skip_whitespace(out, pos + len(PYTHON_TAG))
        if not out.startswith("{", pos):
            return no_tool_calls(out)
        calls: list[ToolCall] = []
        try:
            while True:
                obj, pos = raw_decode_strict(out, pos)
                calls.append(tool_call_from_object(obj, ARGS_KEYS))
                pos = skip_whitespace(out, pos)
                if pos == len(out):
                    break
                if out[pos] != SEPARATOR:
                    raise Malformed(f"text after a tool call at {pos}")
                pos = skip_whitespace(out, pos + 1)
                if pos == len(out):
                    break
        except (ValueError, RecursionError):
            return no_tool_calls(out)
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=None)

    def _advance(self, final: bool) -> None:
        text = self._text
        while not self._content_only:
            if self._state == _START:
                self._pending = 0  # nothing goes out before the output is known to be calls
                at = skip_whitespace(text, 0)
                if at == len(text):
                    if final:
                        self._malformed(at, call_started=False)
                    return
                tag = match_literal(text, at, PYTHON_TAG, final)
                if tag == 0:
                    return
                if tag == 1:
                    at = skip_whitespace(text, at + len(PYTHON_TAG))
                    if at == len(text):
                        if final:
                            self._malformed(at, call_started=False)
                        return
                if text[at] != "{":
                    self._malformed(at, call_started=False)
                    return
                self._begin_call(at)
            elif self._state == _CALL:
                if not self._feed_json_call(self._call, text, final):
                    return
                self._state = _AFTER
            else:  # _AFTER: whitespace, then the end or a separator and the next call
                self._open_call(self._pos)
                at = skip_whitespace(text, self._pos)
                if at < len(text) and text[at] == SEPARATOR:
                    at = skip_whitespace(text, at + 1)
                    if at < len(text):
                        if text[at] != "{":
                            self._malformed(at, call_started=False)
                            return
                        self._begin_call(at)
                        continue
                elif at < len(text):
                    self._malformed(at, call_started=False)
                    return
                if final:
                    self._pending = None  # trailing whitespace and separator after the calls
                return

    def _begin_call(self, at: int) -> None:
        self._call = JsonObjectCallStream(at, ARGS_KEYS)
        self._index = None
        self._pos = at
        self._state = _CALL
