"""Qwen3 (hybrid thinking): the model opens and closes its thinking itself:

    <think>
    The user wants 2 + 2, which is 4.
    </think>

    2 + 2 = 4.

Reasoning is only what lies inside ``<think>...</think>``; an output without ``<think>`` (the
request set ``enable_thinking: false``, so the template already closed an empty block) is all
content, and an opening tag without a closing one was cut off while thinking, so what follows
it is reasoning. Text before ``<think>`` and after ``</think>`` is content. The thinking-only
Qwen3-2507 models, whose template opens the block in the prompt, take ``deepseek_r1``.
"""

from __future__ import annotations

from deepbatch.api.reasoning.base import _CONTENT, _REASONING, ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self._state = "before"

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        before, tag, rest = model_output.partition(self.start_token)
        if not tag:
            return None, model_output or None
        reasoning, _, after = rest.partition(self.end_token)
        return reasoning or None, (before + after) or None

    def _advance(self, final: bool) -> None:
        if self._state == "before" and self._until_tag(self.start_token, _CONTENT, final):
            self._state = _REASONING
        if self._state == _REASONING and self._until_tag(self.end_token, _REASONING, final):
            self._state = "after"
        if self._state == "after":
            self._send(_CONTENT, len(self._text))
