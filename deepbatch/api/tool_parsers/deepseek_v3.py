"""DeepSeek tool calls, in the markers of the DeepSeek tokenizers (special tokens: decode with
them kept). The markers are written with U+FF5C FULLWIDTH VERTICAL LINE and U+2581 LOWER ONE
EIGHTH BLOCK:

    <｜tool▁calls▁begin｜>  <｜tool▁calls▁end｜>  <｜tool▁call▁begin｜>  <｜tool▁call▁end｜>  <｜tool▁sep｜>

``deepseek_v3`` (DeepSeek-V3, V3-0324, R1, R1-0528 and the R1 distills, whose chat templates
write a call as the type, the name and a fenced JSON block):

    Let me look that up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {"tz": "CET"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

``deepseek_v31`` (DeepSeek-V3.1 and later: the name, then the bare JSON):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before ``<｜tool▁calls▁begin｜>`` (and any after ``<｜tool▁calls▁end｜>``) is content; only
whitespace may come between calls. The arguments are returned as the model wrote them.
"""

from __future__ import annotations

from deepbatch.api.parser_types import ExtractedToolCalls, ToolCall
from deepbatch.api.tool_parsers.base import (
    JsonArgumentsStream,
    Malformed,
    ToolParser,
    join_outside,
    make_tool_call_id,
    match_literal,
    no_tool_calls,
    partial_marker_len,
    skip_whitespace,
)
from deepbatch.api.tool_parsers.json_stream import WHITESPACE, raw_decode_strict

TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
MARKER_OPEN = "<｜"  # how every DeepSeek marker begins; never part of a name

_OUTSIDE, _SECTION, _HEAD, _ARGS, _TAIL = range(5)

# What a head reader returns: ("ok", name, args_pos), ("wait",) or ("bad", pos).
Head = tuple


class DeepSeekV3ToolParser(ToolParser):
    # The literals after a call's arguments, each optionally preceded by whitespace.
    TAIL: tuple[str, ...] = ("```", TOOL_CALL_END)

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._state = _OUTSIDE
        self._section_calls = 0
        self._name = ""
        self._args: JsonArgumentsStream | None = None
        self._index: int | None = None
        self._tail_step = 0

    # -- one call's head: the format's own part ---------------------------------------------

    def _parse_head(self, out: str, pos: int) -> tuple[str, int]:
        """Non-streaming: ``(name, position of the arguments' first character)``."""
        head = "function" + TOOL_SEP
        if not out.startswith(head, pos):
            raise Malformed("a call begins with its type, function")
        pos += len(head)
        end = pos
        while end < len(out) and out[end] not in WHITESPACE:
            end += 1
        name = out[pos:end]
        if not name or MARKER_OPEN in name or end == len(out):
            raise Malformed("a call's name ends at a newline")
        pos = skip_whitespace(out, end)
        if not out.startswith("```json", pos):
            raise Malformed("the arguments are in a ```json block")
        return name, skip_whitespace(out, pos + len("```json"))

    def _read_head(self, text: str, pos: int, final: bool) -> Head:
        """Streaming: the head of the call whose begin marker ends at ``pos``, if complete."""
        head = "function" + TOOL_SEP
        found = match_literal(text, pos, head, final)
        if found <= 0:
            return ("wait",) if found == 0 else ("bad", pos)
        pos += len(head)
        end = pos
        while end < len(text) and text[end] not in WHITESPACE:
            end += 1
        name = text[pos:end]
        if MARKER_OPEN in name:
            return ("bad", pos)
        if end == len(text):
            return ("bad", pos) if final else ("wait",)
        if not name:
            return ("bad", pos)
        fence = skip_whitespace(text, end)
        found = match_literal(text, fence, "```json", final)
        if found <= 0:
            return ("wait",) if found == 0 else ("bad", fence)
        return ("ok", name, fence + len("```json"))

    # -- non-streaming ------------------------------------------------------------------------

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        out = model_output
        if TOOL_CALLS_BEGIN not in out:
            return no_tool_calls(out)
        calls: list[ToolCall] = []
        outside: list[str] = []
        pos = 0
        try:
            while True:
                begin = out.find(TOOL_CALLS_BEGIN, pos)
                if begin < 0:
                    outside.append(out[pos:])
                    break
                outside.append(out[pos:begin])
                pos, section = self._parse_section(out, begin + len(TOOL_CALLS_BEGIN))
                calls.extend(section)
        except (ValueError, RecursionError):
            return no_tool_calls(out)
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=join_outside(outside))

    def _parse_section(self, out: str, pos: int) -> tuple[int, list[ToolCall]]:
        calls = []
        while True:
            pos = skip_whitespace(out, pos)
            if out.startswith(TOOL_CALL_BEGIN, pos):
                name, pos = self._parse_head(out, pos + len(TOOL_CALL_BEGIN))
                if not out.startswith("{", pos):
                    raise Malformed("the arguments are a JSON object")
                _, end = raw_decode_strict(out, pos)
                calls.append(ToolCall(id=make_tool_call_id(), name=name, arguments=out[pos:end]))
                pos = end
                for literal in self.TAIL:
                    pos = skip_whitespace(out, pos)
                    if not out.startswith(literal, pos):
                        raise Malformed(f"expected {literal} at {pos}")
                    pos += len(literal)
                continue
            if not calls:
                raise Malformed("a tool-call section without calls")
            if out.startswith(TOOL_CALLS_END, pos):
                return pos + len(TOOL_CALLS_END), calls
            if pos == len(out):  # the output ended after a complete call
                return pos, calls
            raise Malformed(f"unexpected text between tool calls at {pos}")

    # -- streaming ------------------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        text = self._text
        while not self._content_only:
            state = self._state
            if state == _OUTSIDE:
                begin = text.find(TOOL_CALLS_BEGIN, self._pos)
                if begin < 0:
                    hold = 0 if final else partial_marker_len(text, self._pos, (TOOL_CALLS_BEGIN,))
                    self._outside(len(text) - hold)
                    if final:
                        self._outside_ended()
                    return
                self._outside(begin)
                self._open_call(begin)
                self._pos = begin + len(TOOL_CALLS_BEGIN)
                self._state = _SECTION
                self._section_calls = 0
            elif state == _SECTION:
                self._open_call(self._pos)
                at = skip_whitespace(text, self._pos)
                if at == len(text):
                    if final:
                        self._end_section(at)
                    return
                begin = match_literal(text, at, TOOL_CALL_BEGIN, final)
                end = match_literal(text, at, TOOL_CALLS_END, final)
                if begin == 1:
                    self._pos = at + len(TOOL_CALL_BEGIN)
                    self._state = _HEAD
                elif end == 1:
                    self._end_section(at + len(TOOL_CALLS_END))
                elif begin == 0 or end == 0:
                    return
                else:
                    self._malformed(at, call_started=False)
            elif state == _HEAD:
                head = self._read_head(text, self._pos, final)
                if head[0] == "wait":
                    return
                if head[0] == "bad":
                    self._malformed(head[1], call_started=False)
                    return
                _, self._name, args_pos = head
                self._args = JsonArgumentsStream(args_pos)
                self._index = None
                self._pos = args_pos
                self._state = _ARGS
            elif state == _ARGS:
                args = self._args
                args.feed(text)
                if self._index is None and args.value_started:
                    self._index = self._start_call(self._name)
                    self._section_calls += 1
                if self._index is not None:
                    self._send_arguments(self._index, args.take_arguments())
                if args.error_at is not None:
                    self._malformed(args.error_at, call_started=self._index is not None)
                    return
                if args.end_at is None:
                    self._pos = len(text)
                    if final and self._index is None:
                        self._malformed(len(text), call_started=False)
                    return
                self._pos = args.end_at
                self._state = _TAIL
                self._tail_step = 0
            else:  # _TAIL
                while self._tail_step < len(self.TAIL):
                    literal = self.TAIL[self._tail_step]
                    at = skip_whitespace(text, self._pos)
                    found = match_literal(text, at, literal, final)
                    if found == 0:
                        return
                    if found < 0:
                        self._malformed(at, call_started=True)
                        return
                    self._pos = at + len(literal)
                    self._tail_step += 1
                self._state = _SECTION

    def _end_section(self, pos: int) -> None:
        if self._section_calls == 0:
            self._malformed(pos, call_started=False)
            return
        self._pending = None
        self._segment_has_text = False
        self._pos = pos
        self._state = _OUTSIDE


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    TAIL = (TOOL_CALL_END,)

    def _parse_head(self, out: str, pos: int) -> tuple[str, int]:
        sep = out.find(TOOL_SEP, pos)
        if sep < 0:
            raise Malformed("a call's name ends at <｜tool▁sep｜>")
        name = out[pos:sep].strip(WHITESPACE)
        if not name or MARKER_OPEN in name or "\n" in out[pos:sep]:
            raise Malformed("a call's name is one line without markers")
        return name, skip_whitespace(out, sep + len(TOOL_SEP))

    def _read_head(self, text: str, pos: int, final: bool) -> Head:
        sep = text.find(TOOL_SEP, pos)
        stop = len(text) if sep < 0 else sep
        marker = text.find(MARKER_OPEN, pos, stop)
        newline = text.find("\n", pos, stop)
        if newline >= 0:
            return ("bad", newline)
        if sep < 0:
            # Only a tail that may grow into <｜tool▁sep｜> may hold a marker's opening.
            if final or (marker >= 0 and not TOOL_SEP.startswith(text[marker:])):
                return ("bad", pos if marker < 0 else marker)
            return ("wait",)
        name = text[pos:sep].strip(WHITESPACE)
        if not name or marker >= 0:
            return ("bad", pos)
        return ("ok", name, skip_whitespace(text, sep + len(TOOL_SEP)))
