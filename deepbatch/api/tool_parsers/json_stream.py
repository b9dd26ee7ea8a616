"""Incremental JSON for streamed tool calls.

``JsonScanner`` reads one JSON value as its text grows and knows at every character whether the
text so far can still become valid JSON (RFC 8259, as strict as ``json.loads`` with NaN and
Infinity refused), where the value began and where it ended, and, for an object, where each
top-level member's value lies. Arguments are then streamed as raw slices of the model's own
text: every character inside an unfinished value belongs to that value, so a fragment, once
sent, never needs to be taken back (re-serialising a partial parse would have to guess how
strings and numbers end).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_PLAIN_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")

# Scanner states: what the next non-space character may be.
_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER_VALUE, _ARR_FIRST = range(6)
_STRING, _NUMBER_TOK, _LITERAL, _DONE = range(6, 10)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str):
    """``json.loads`` without the NaN/Infinity extension, so that it accepts what the scanner does."""
    return json.loads(text, parse_constant=_refuse_constant)


def raw_decode_strict(text: str, pos: int):
    """``(value, end)`` of the JSON value at ``text[pos]`` (no leading whitespace allowed there)."""
    return _STRICT_DECODER.raw_decode(text, pos)


_STRICT_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


@dataclass
class Member:
    """A member of the top-level object; positions index the scanner's text."""

    key: str
    value_start: int | None = None
    value_end: int | None = None


class JsonScanner:
    """Consumes the text of one JSON value (leading whitespace allowed) piece by piece.

    ``error`` is the index of the first character that cannot continue valid JSON; ``end`` the
    index just past the completed value (the scanner consumes nothing after it, so the caller
    decides what may follow); ``members`` the top-level object's members in order.
    """

    def __init__(self, require_object: bool = True):
        self.require_object = require_object
        self.text = ""
        self.pos = 0
        self.start: int | None = None
        self.end: int | None = None
        self.error: int | None = None
        self.members: list[Member] = []
        self._stack: list[str] = []
        self._state = _VALUE
        self._string_is_key = False
        self._token_start = 0
        self._escape = 0  # 0: none, -1: after a backslash, n > 0: hex digits of \u still due

    @property
    def finished(self) -> bool:
        return self.end is not None or self.error is not None

    def feed(self, chunk: str) -> None:
        self.text += chunk
        self._scan()

    def member(self, *keys: str) -> Member | None:
        """The first top-level member whose key is one of ``keys``."""
        for m in self.members:
            if m.key in keys:
                return m
        return None

    # -- the state machine -------------------------------------------------------------------

    def _scan(self) -> None:
        s = self.text
        n = len(s)
        i = self.pos
        while i < n and self.end is None and self.error is None:
            state = self._state
            c = s[i]
            if state == _STRING:
                i = self._string_char(s, i)
                continue
            if state == _NUMBER_TOK:
                if c in _NUMBER_CHARS:
                    i += 1
                    continue
                if not _NUMBER.fullmatch(s, self._token_start, i):
                    self.error = self._token_start
                    break
                self._end_value(i)
                continue  # c is the first character after the number: scan it in the new state
            if state == _LITERAL:
                word = s[self._token_start : i + 1]
                if not any(lit.startswith(word) for lit in _LITERALS):
                    self.error = i
                    break
                i += 1
                if word in _LITERALS:
                    self._end_value(i)
                continue
            if c in WHITESPACE:
                i += 1
                continue
            if state == _VALUE or (state == _ARR_FIRST and c != "]"):
                self._begin_value(s, i)
                i += 1
            elif state in (_OBJ_FIRST, _OBJ_KEY):
                if c == '"':
                    self._state = _STRING
                    self._string_is_key = True
                    self._token_start = i
                elif c == "}" and state == _OBJ_FIRST:
                    self._close(i)
                else:
                    self.error = i
                i += 1
            elif state == _COLON:
                if c == ":":
                    self._state = _VALUE
                else:
                    self.error = i
                i += 1
            elif state == _AFTER_VALUE:
                top = self._stack[-1]
                if c == ",":
                    self._state = _OBJ_KEY if top == "{" else _VALUE
                elif c == ("}" if top == "{" else "]"):
                    self._close(i)
                else:
                    self.error = i
                i += 1
            elif state == _ARR_FIRST:  # c == "]"
                self._close(i)
                i += 1
        self.pos = i

    def _string_char(self, s: str, i: int) -> int:
        if self._escape == 0:
            run = _PLAIN_STRING_RUN.match(s, i)
            if run is not None:
                return run.end()
            c = s[i]
            if c == '"':
                self._end_string(i + 1)
            elif c == "\\":
                self._escape = -1
            else:  # a raw control character, which JSON strings may not hold
                self.error = i
            return i + 1
        c = s[i]
        if self._escape == -1:
            if c == "u":
                self._escape = 4
            elif c in '"\\/bfnrt':
                self._escape = 0
            else:
                self.error = i
        elif c in _HEX:
            self._escape -= 1
        else:
            self.error = i
        return i + 1

    def _begin_value(self, s: str, i: int) -> None:
        c = s[i]
        if not self._stack:
            self.start = i
            if self.require_object and c != "{":
                self.error = i
                return
        elif len(self._stack) == 1 and self._stack[0] == "{":
            self.members[-1].value_start = i
        if c == "{":
            self._stack.append("{")
            self._state = _OBJ_FIRST
        elif c == "[":
            self._stack.append("[")
            self._state = _ARR_FIRST
        elif c == '"':
            self._state = _STRING
            self._string_is_key = False
            self._token_start = i
        elif c == "-" or "0" <= c <= "9":
            self._state = _NUMBER_TOK
            self._token_start = i
        elif c in "tfn":
            self._state = _LITERAL  # the letters that follow are checked in the literal state
            self._token_start = i
        else:
            self.error = i

    def _end_string(self, end: int) -> None:
        if self._string_is_key:
            if len(self._stack) == 1:
                self.members.append(Member(key=json.loads(self.text[self._token_start : end])))
            self._state = _COLON
        else:
            self._end_value(end)

    def _close(self, i: int) -> None:
        self._stack.pop()
        self._end_value(i + 1)

    def _end_value(self, end: int) -> None:
        if not self._stack:
            self.end = end
            self._state = _DONE
            return
        if len(self._stack) == 1 and self._stack[0] == "{":
            self.members[-1].value_end = end
        self._state = _AFTER_VALUE
