"""Reasoning parsers, by the names of vLLM's ``--reasoning-parser``."""

from __future__ import annotations

from deepbatch.api.reasoning.base import ReasoningParser
from deepbatch.api.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from deepbatch.api.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = ["REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser", "get_reasoning_parser"]
