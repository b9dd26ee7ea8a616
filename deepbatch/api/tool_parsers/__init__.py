"""Tool-call parsers, by the names of vLLM's ``--tool-call-parser``."""

from __future__ import annotations

from deepbatch.api.tool_parsers.base import ToolParser
from deepbatch.api.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from deepbatch.api.tool_parsers.hermes import Hermes2ProToolParser
from deepbatch.api.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "Hermes2ProToolParser",
    "Llama3JsonToolParser",
    "ToolParser",
    "get_tool_parser",
]
