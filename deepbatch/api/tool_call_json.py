"""Tool calls read out of the JSON that ``tool_choice="required"`` constrains the output to,
``[{"name": "f", "parameters": {...}}, ...]``, as the text arrives.

The scanner keeps its place between calls, so a stream costs one pass over the text. A call is
known once its name string is complete; its arguments are the raw JSON text of its
``parameters`` value, handed out as it grows, so the fragments a stream sends add up to exactly
the text a whole reply carries. Key order and whitespace do not matter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ScannedCall:
    name: str | None = None
    args_start: int | None = None  # offset of the parameters value in the text
    args_end: int | None = None  # one past its end, once it is complete


class ToolCallArrayScanner:
    def __init__(self):
        self.text = ""
        self.calls: list[ScannedCall] = []
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._expect_key = False  # inside an item: the next string is a key
        self._key: str | None = None

    def feed(self, delta: str) -> None:
        self.text += delta
        text = self.text
        for j in range(self._pos, len(text)):
            ch = text[j]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._string_done(j)
                continue
            if ch == '"':
                self._value_starts(j)
                self._in_string = True
                self._string_start = j
            elif ch in "{[":
                self._value_starts(j)
                self._depth += 1
                if self._depth == 2 and ch == "{":  # an item of the top-level array
                    self.calls.append(ScannedCall())
                    self._expect_key, self._key = True, None
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 2 and self._in_arguments():  # the parameters object closed
                    self.calls[-1].args_end = j + 1
                elif self._depth == 1 and self._in_arguments():  # a scalar parameters value ended
                    self.calls[-1].args_end = j
            elif self._depth == 2 and ch == ":":
                self._expect_key = False
            elif self._depth == 2 and ch == ",":
                if self._in_arguments():
                    self.calls[-1].args_end = j
                self._expect_key, self._key = True, None
            elif not ch.isspace():
                self._value_starts(j)
        self._pos = len(text)

    def arguments(self, call: ScannedCall) -> str:
        """The arguments text so far (all of it once the call is complete)."""
        if call.args_start is None:
            return ""
        end = call.args_end if call.args_end is not None else len(self.text)
        return self.text[call.args_start:end]

    def _in_arguments(self) -> bool:
        if not self.calls or self._key != "parameters":
            return False
        call = self.calls[-1]
        return call.args_start is not None and call.args_end is None

    def _value_starts(self, j: int) -> None:
        if (self._depth == 2 and not self._expect_key and self._key == "parameters" and self.calls
                and self.calls[-1].args_start is None):
            self.calls[-1].args_start = j

    def _string_done(self, j: int) -> None:
        if self._depth != 2 or not self.calls:
            return
        raw = self.text[self._string_start:j + 1]
        if self._expect_key:
            self._key = _decode(raw)
        elif self._key == "name":
            self.calls[-1].name = _decode(raw)
        elif self._key == "parameters" and self.calls[-1].args_end is None:
            self.calls[-1].args_end = j + 1


def _decode(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
