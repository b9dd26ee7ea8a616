"""Chat streams put back together the way an OpenAI client does: per choice index, the content
and reasoning fragments joined, tool calls assembled from their deltas (id, type and name in the
first, argument fragments after it, matched by index), and the finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamedChoice:
    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict] = field(default_factory=dict)  # index -> {"id", "type", "name", "arguments"}
    finish_reason: str | None = None
    deltas: list = field(default_factory=list)

    def calls(self) -> list[dict]:
        return [self.tool_calls[i] for i in sorted(self.tool_calls)]


def add_chunk(choices: dict[int, StreamedChoice], chunk) -> None:
    for c in chunk.choices:
        got = choices.setdefault(c.index, StreamedChoice())
        delta = c.delta
        got.deltas.append(delta)
        got.content += delta.content or ""
        got.reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.index not in got.tool_calls:
                # The first delta of a call names it; a later one may not introduce a call.
                assert call.id and call.function and call.function.name, call
                got.tool_calls[call.index] = {"id": call.id, "type": call.type, "name": call.function.name,
                                              "arguments": ""}
            else:
                assert call.id is None and (call.function is None or call.function.name is None), call
            got.tool_calls[call.index]["arguments"] += (call.function.arguments or "") if call.function else ""
        if c.finish_reason is not None:
            assert got.finish_reason is None, "two finish reasons for one choice"
            got.finish_reason = c.finish_reason


def collect(stream) -> dict[int, StreamedChoice]:
    choices: dict[int, StreamedChoice] = {}
    for chunk in stream:
        add_chunk(choices, chunk)
    return choices


async def collect_async(stream) -> dict[int, StreamedChoice]:
    choices: dict[int, StreamedChoice] = {}
    async for chunk in stream:
        add_chunk(choices, chunk)
    return choices
