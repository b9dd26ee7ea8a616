"""The tool-call parser interface and the streaming machinery every format shares.

A parser turns a model's output, decoded with the format's marker tokens kept, into OpenAI tool
calls. ``extract_tool_calls`` reads a whole output; ``extract_tool_calls_streaming`` is fed the
growing text and returns what may be sent now: content, then for each call one fragment with its
id and name followed by fragments of its arguments' JSON text. One instance serves one
request/choice.

Streaming holds text back only while it cannot yet be classified: a possible prefix of a marker,
whitespace that is dropped if a tool call follows, a call whose name has not been read. What is
sent is never taken back, so a call that turns out malformed after its name went out stays sent
and the rest of the output follows as content; malformed text caught before that goes out as
content, exactly as ``extract_tool_calls`` would return it. ``finish_streaming`` releases what
is still held when the output ends.

The content rule, the same in both modes: with no tool call the whole output is content; with
tool calls, the text outside them is content, each stretch of it kept verbatim unless it is only
whitespace.
"""

from __future__ import annotations

import json
import uuid

from deepbatch.api.parser_types import DeltaMessage, DeltaToolCall, ExtractedToolCalls, ToolCall
from deepbatch.api.tool_parsers.json_stream import WHITESPACE, JsonScanner, loads_strict


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def partial_marker_len(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of a marker: the
    part that must wait for the next delta before it can be called text."""
    tail = text[start:]
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(tail)), best, -1):
            if tail.endswith(marker[:n]):
                best = n
                break
    return best


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def match_literal(text: str, pos: int, literal: str, final: bool) -> int:
    """1: ``literal`` is at ``pos``; 0: it may still be (the text ends inside it); -1: it is not."""
    if text.startswith(literal, pos):
        return 1
    if not final and literal.startswith(text[pos:]):
        return 0
    return -1


def no_tool_calls(model_output: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)


def join_outside(segments: list[str]) -> str | None:
    """The content of an output with tool calls: its outside stretches, whitespace-only ones dropped."""
    content = "".join(s for s in segments if s.strip(WHITESPACE))
    return content or None


class Malformed(ValueError):
    """Raised inside ``extract_tool_calls`` implementations; the output then is all content."""


class ToolParser:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._text = ""
        self._pos = 0  # text before this has been classified
        # Start of text consumed but neither sent nor dropped: whitespace that goes if a call
        # follows, and the markers and JSON of a call whose name is not sent yet.
        self._pending: int | None = None
        self._segment_has_text = False
        self._content_only = False
        self._num_calls = 0
        self._out_content: list[str] = []
        self._out_calls: list[DeltaToolCall] = []

    # -- the interface ----------------------------------------------------------------------

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str) -> DeltaMessage | None:
        self._text = current_text
        self._run(final=False)
        return self._take_delta()

    def finish_streaming(self) -> DeltaMessage | None:
        """What was held back, once the output has ended (call after the last delta)."""
        self._run(final=True)
        return self._take_delta()

    # -- for the formats --------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        """Classify ``self._text`` from ``self._pos`` on as far as it can be; ``final``: no more
        text will come."""
        raise NotImplementedError

    def _run(self, final: bool) -> None:
        if self._content_only:
            self._send_content(self._pos, len(self._text))
            self._pos = len(self._text)
            return
        self._advance(final)
        if self._content_only:
            self._run(final)

    def _outside(self, end: int) -> None:
        """``text[pos:end]`` lies outside any tool call."""
        start, self._pos = self._pos, end
        if start >= end:
            return
        if self._segment_has_text:
            self._send_content(start, end)
        elif self._text[start:end].strip(WHITESPACE):
            self._send_content(start if self._pending is None else self._pending, end)
            self._pending = None
            self._segment_has_text = True
        elif self._pending is None:
            self._pending = start

    def _outside_ended(self) -> None:
        """The output ended outside a call: held whitespace is content only if no call came."""
        if self._pending is not None and self._num_calls == 0:
            self._send_content(self._pending, len(self._text))
        self._pending = None

    def _open_call(self, start: int) -> None:
        """The markers or JSON of a call begin at ``start``; held until its name is sent."""
        if self._pending is None:
            self._pending = start

    def _start_call(self, name: str) -> int:
        index = self._num_calls
        self._num_calls += 1
        self._out_calls.append(DeltaToolCall(index=index, id=make_tool_call_id(), name=name))
        self._pending = None
        self._segment_has_text = False
        return index

    def _send_arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._out_calls.append(DeltaToolCall(index=index, arguments=fragment))

    def _malformed(self, at: int, call_started: bool) -> None:
        """The text stops being a tool call at ``at``. Nothing of a call not yet started was
        sent, so all that was held goes out as content; after a started call, the text from
        ``at`` does."""
        start = at if call_started or self._pending is None else self._pending
        self._pending = None
        self._pos = start
        self._content_only = True

    def _feed_json_call(self, call, text: str, final: bool) -> bool:
        """Feeds ``text`` to ``call`` (a ``JsonObjectCallStream``), sending its name once known
        and its argument fragments as they grow (``self._index``: the call's index once
        started). True once its object has ended, ``self._pos`` then just past it; False while it
        is incomplete, or when it turned out malformed (handled here)."""
        call.feed(text)
        if self._index is None and call.name is not None and call.error_at is None:
            self._index = self._start_call(call.name)
        if self._index is not None:
            self._send_arguments(self._index, call.take_arguments())
        if call.error_at is not None:
            self._malformed(call.error_at, call_started=self._index is not None)
            return False
        if call.end_at is None:
            self._pos = len(text)
            if final and self._index is None:
                self._malformed(len(text), call_started=False)
            return False
        self._pos = call.end_at
        return True

    def _send_content(self, start: int, end: int) -> None:
        if end > start:
            self._out_content.append(self._text[start:end])

    def _take_delta(self) -> DeltaMessage | None:
        content = "".join(self._out_content)
        calls: list[DeltaToolCall] = []
        for frag in self._out_calls:
            if calls and calls[-1].index == frag.index and frag.id is None:
                last = calls[-1]
                last.arguments = (last.arguments or "") + (frag.arguments or "")
            else:
                calls.append(frag)
        self._out_content.clear()
        self._out_calls.clear()
        if not content and not calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=calls)


class JsonArgumentsStream:
    """A call's arguments as one JSON object at ``text[base:]``, its name known from markers."""

    def __init__(self, base: int):
        self.base = base
        self.scanner = JsonScanner(require_object=True)
        self._sent: int | None = None

    def feed(self, text: str) -> None:
        self.scanner.feed(text[self.base + len(self.scanner.text) :])

    @property
    def error_at(self) -> int | None:
        return None if self.scanner.error is None else self.base + self.scanner.error

    @property
    def end_at(self) -> int | None:
        return None if self.scanner.end is None else self.base + self.scanner.end

    @property
    def value_started(self) -> bool:
        return self.scanner.error is None and self._object_begun(self.scanner.start)

    def _object_begun(self, start: int | None) -> bool:
        """The object at ``start`` has shown a valid first member or its end: a call is sent
        only then, so that a Python dict or other non-JSON after the brace stays content."""
        if start is None:
            return False
        return skip_whitespace(self.scanner.text, start + 1) < len(self.scanner.text)

    def take_arguments(self) -> str:
        sc = self.scanner
        return self._take(sc.start, sc.end)

    def _take(self, start: int | None, end: int | None) -> str:
        sc = self.scanner
        if start is None:
            return ""
        if end is None:
            end = sc.error if sc.error is not None else len(sc.text)
        if self._sent is None:
            self._sent = start
        fragment = sc.text[self._sent : end]
        self._sent = max(self._sent, end)
        return fragment


class JsonObjectCallStream(JsonArgumentsStream):
    """A call written as one JSON object, ``{"name": ..., "<args key>": {...}}``, at
    ``text[base:]``; other keys are allowed. The name goes out once the arguments object has
    begun, so an object without arguments (an answer that happens to be JSON) is never sent
    as a call."""

    def __init__(self, base: int, args_keys: tuple[str, ...]):
        super().__init__(base)
        self.args_keys = args_keys
        self.name: str | None = None
        self._bad_at: int | None = None

    @property
    def error_at(self) -> int | None:
        if self._bad_at is not None:
            return self.base + self._bad_at
        return super().error_at

    def feed(self, text: str) -> None:
        super().feed(text)
        if self._bad_at is not None or self.scanner.error is not None or self.name is not None:
            return
        sc = self.scanner
        name_m = sc.member("name")
        args_m = sc.member(*self.args_keys)
        if name_m is not None and name_m.value_start is not None and sc.text[name_m.value_start] != '"':
            self._bad_at = name_m.value_start
        elif args_m is not None and args_m.value_start is not None and sc.text[args_m.value_start] != "{":
            self._bad_at = args_m.value_start
        elif name_m is not None and name_m.value_end is not None and args_m is not None and self._object_begun(args_m.value_start):
            name = loads_strict(sc.text[name_m.value_start : name_m.value_end])
            if name:
                self.name = name
            else:
                self._bad_at = name_m.value_start
        elif sc.end is not None:
            self._bad_at = sc.end - 1  # the object closed without a name or arguments

    def take_arguments(self) -> str:
        args_m = self.scanner.member(*self.args_keys)
        if self.name is None or args_m is None:
            return ""
        return self._take(args_m.value_start, args_m.value_end)


def tool_call_from_object(obj, args_keys: tuple[str, ...]) -> ToolCall:
    """A call from a decoded ``{"name": ..., "<args key>": {...}}``, the arguments re-serialised."""
    if not isinstance(obj, dict):
        raise Malformed("a tool call is a JSON object")
    name = obj.get("name")
    key = next((k for k in obj if k in args_keys), None)
    if not isinstance(name, str) or not name or key is None or not isinstance(obj[key], dict):
        raise Malformed("a tool call needs a name and an arguments object")
    return ToolCall(id=make_tool_call_id(), name=name, arguments=json.dumps(obj[key], ensure_ascii=False))
