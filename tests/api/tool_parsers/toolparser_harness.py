"""Streaming a recorded output through a tool parser in several delta splits, and comparing the
concatenated deltas with the non-streaming result."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from deepbatch.api.parser_types import DeltaMessage, ExtractedToolCalls

ID_RE = re.compile(r"chatcmpl-tool-[0-9a-f]{16,}")


def token_deltas(tokenizer, text: str) -> list[str]:
    """The deltas the engine's detokenizer produces for ``text`` (DecodeStream, markers kept)."""
    from tokenizers.decoders import DecodeStream

    ids = tokenizer.encode(text, add_special_tokens=False).ids
    stream = DecodeStream(skip_special_tokens=False)
    pieces = [p for p in (stream.step(tokenizer, i) for i in ids) if p]
    assert "".join(pieces) == text, "the tokenizer does not round-trip the recorded output"
    return pieces


def random_deltas(text: str, seed: int, max_len: int) -> list[str]:
    rnd = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rnd.randint(1, max_len)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def splits(text: str, tokenizer=None) -> dict[str, list[str]]:
    out = {"whole": [text], "per_char": list(text)}
    for seed, max_len in enumerate((2, 3, 5, 8, 13, 40)):
        out[f"random{seed}_max{max_len}"] = random_deltas(text, seed, max_len)
    if tokenizer is not None:
        out["per_token"] = token_deltas(tokenizer, text)
    return out


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Streamed:
    content: str = ""
    calls: list[StreamedCall] = field(default_factory=list)
    deltas: list[DeltaMessage] = field(default_factory=list)


def stream(parser, pieces: list[str]) -> Streamed:
    """Feed ``pieces`` as deltas, then finish; check the shape of every delta on the way."""
    result = Streamed()
    previous = ""
    deltas = []
    for piece in pieces:
        current = previous + piece
        deltas.append(parser.extract_tool_calls_streaming(previous, current, piece))
        previous = current
    deltas.append(parser.finish_streaming())
    for delta in deltas:
        if delta is None:
            continue
        assert delta.content or delta.tool_calls, "an empty delta instead of None"
        assert delta.reasoning_content is None
        result.deltas.append(delta)
        result.content += delta.content or ""
        for frag in delta.tool_calls:
            if frag.index == len(result.calls):  # a new call: its first fragment names it
                assert frag.id and ID_RE.fullmatch(frag.id) and frag.name, frag
                result.calls.append(StreamedCall(frag.id, frag.name))
            else:
                assert frag.index == len(result.calls) - 1, "fragments of an earlier call after a later one"
                assert frag.id is None and frag.name is None, "a call's name was sent twice"
            result.calls[frag.index].arguments += frag.arguments or ""
    assert len({c.id for c in result.calls}) == len(result.calls)
    return result


def assert_same(streamed: Streamed, extracted: ExtractedToolCalls) -> None:
    assert extracted.tools_called == bool(extracted.tool_calls)
    assert (streamed.content or None) == extracted.content
    assert [c.name for c in streamed.calls] == [c.name for c in extracted.tool_calls]
    assert [json.loads(c.arguments) for c in streamed.calls] == [json.loads(c.arguments) for c in extracted.tool_calls]


def check_all_splits(parser_cls, text: str, tokenizer=None) -> ExtractedToolCalls:
    """The non-streaming result, after checking that every split of ``text`` streams to it."""
    extracted = parser_cls(tokenizer).extract_tool_calls(text)
    for name, pieces in splits(text, tokenizer).items():
        try:
            assert_same(stream(parser_cls(tokenizer), pieces), extracted)
        except AssertionError as e:
            raise AssertionError(f"split {name}: {e}") from e
    return extracted


def call_tuples(extracted: ExtractedToolCalls) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls]
