"""The incremental JSON scanner behind argument streaming, checked against ``json.loads``."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepbatch.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from deepbatch.api.tool_parsers.base import partial_marker_len
from deepbatch.api.tool_parsers.json_stream import JsonScanner, loads_strict

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=5)
layouts = st.sampled_from([
    dict(), dict(ensure_ascii=False), dict(indent=2), dict(separators=(",", ":")), dict(indent="\t", ensure_ascii=False),
])


def scan(text: str, pieces: list[str] | None = None) -> JsonScanner:
    scanner = JsonScanner()
    for piece in pieces if pieces is not None else [text]:
        scanner.feed(piece)
    return scanner


def state(s: JsonScanner):
    return s.start, s.end, s.error, [(m.key, m.value_start, m.value_end) for m in s.members]


def chunks(text: str, seed: int) -> list[str]:
    rnd = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rnd.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


@SETTINGS
@given(obj=json_objects, layout=layouts, lead=st.sampled_from(["", " ", "\n\t "]), seed=st.integers(0, 99))
def test_valid_objects_scan_to_their_end_and_members(obj, layout, lead, seed):
    text = lead + json.dumps(obj, **layout)
    whole = scan(text)
    assert whole.error is None and whole.start == len(lead) and whole.end == len(text)
    assert [m.key for m in whole.members] == list(obj)
    for m in whole.members:
        assert loads_strict(text[m.value_start : m.value_end]) == obj[m.key]
    assert state(scan(text, chunks(text, seed))) == state(whole)
    per_char = JsonScanner()
    for ch in text[:-1]:  # every proper prefix is still valid and unfinished
        per_char.feed(ch)
        assert per_char.error is None and per_char.end is None


ALPHABET = '{}[]":,. \n\\-+0123456789eEtrufalsn\tx\x01é'


@SETTINGS
@given(obj=json_objects, edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["ins", "del", "rep"]),
                                                   st.sampled_from(ALPHABET)), min_size=1, max_size=3))
def test_mutated_text_is_accepted_exactly_when_json_loads_accepts_it(obj, edits):
    text = json.dumps(obj, ensure_ascii=False)
    for pos, op, ch in edits:
        pos %= len(text) + 1
        if op == "ins":
            text = text[:pos] + ch + text[pos:]
        elif op == "del":
            text = text[:pos] + text[pos + 1 :]
        else:
            text = text[:pos] + ch + text[pos + 1 :]
    try:
        expected = isinstance(loads_strict(text), dict)
    except (ValueError, RecursionError):
        expected = False
    s = scan(text)
    accepted = s.error is None and s.end is not None and text[s.end :].strip(" \t\n\r") == ""
    assert accepted == expected, text
    assert state(scan(text, list(text))) == state(s)


@pytest.mark.parametrize("text,error_at", [
    ('{"a": 01}', 6), ('{"a": 1,}', 8), ('{"a": tru}', 9), ('{"a": "x\ny"}', 8), ('[1]', 0), ('{"a": NaN}', 6),
    ('{"a": "\\q"}', 8), ('{"a": "\\u12G4"}', 11), ('{"a" 1}', 5), ("{'a': 1}", 1),
])
def test_error_position(text, error_at):
    assert scan(text).error == error_at


def test_partial_marker_len():
    assert partial_marker_len("abc <tool", 0, ("<tool_call>",)) == 5
    assert partial_marker_len("abc <tool_call>", 0, ("<tool_call>",)) == 0  # whole: found, not held
    assert partial_marker_len("abc <", 4, ("<tool_call>", "<|x|>")) == 1
    assert partial_marker_len("x <|", 0, ("<tool_call>", "<|x|>")) == 2
    assert partial_marker_len("abc", 0, ("<tool_call>",)) == 0


def test_registry():
    assert {"deepseek_v3", "deepseek_v31", "hermes", "llama3_json"} <= set(TOOL_PARSERS)
    for name, cls in TOOL_PARSERS.items():
        assert get_tool_parser(name) is cls
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("no_such_parser")
