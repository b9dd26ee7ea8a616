"""DeepSeek-R1 (and its distills, and Qwen3's thinking-only 2507 models): the chat template ends
the prompt with ``<think>\\n``, so the output opens inside the thinking and usually carries only
the closing tag:

    Okay, the user asks for 2 + 2. That is 4.
    </think>

    2 + 2 = 4.

Everything before ``</think>`` is reasoning, everything after it content; an output without
``</think>`` was cut off while thinking and is all reasoning. A ``<think>`` at the very start
(older templates leave it to the model) is dropped.
"""

from __future__ import annotations

from deepbatch.api.reasoning.base import _CONTENT, _REASONING, ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self._state = "start"

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        text = model_output.removeprefix(self.start_token)
        reasoning, tag, content = text.partition(self.end_token)
        return reasoning or None, (content or None) if tag else None

    def _advance(self, final: bool) -> None:
        if self._state == "start":
            if self._text.startswith(self.start_token):
                self._pos = len(self.start_token)
            elif self.start_token.startswith(self._text) and not final:
                return  # may still become the opening tag
            self._state = _REASONING
        if self._state == _REASONING and self._until_tag(self.end_token, _REASONING, final):
            self._state = _CONTENT
        if self._state == _CONTENT:
            self._send(_CONTENT, len(self._text))
