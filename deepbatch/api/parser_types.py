"""What the tool-call and reasoning parsers hand to the server: plain dataclasses, so that the
parsers import without the server's packages (pydantic, fastapi)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaToolCall:
    """One streamed fragment of tool call ``index``: the first fragment of a call carries its id
    and name, later ones only more of the arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
