"""The reasoning parser interface: split a model's output into its thinking and its answer.

Both modes agree: the concatenated streamed deltas equal ``extract_reasoning``'s result. A tag
never reaches the client; streaming holds back a tail of the text that may be the beginning of
a tag split across deltas, and ``finish_streaming`` releases it once the output has ended.
"""

from __future__ import annotations

from deepbatch.api.parser_types import DeltaMessage

_REASONING, _CONTENT = "reasoning", "content"


def _tag_prefix_len(text: str, start: int, tag: str) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of ``tag``."""
    tail = text[start:]
    for n in range(min(len(tag) - 1, len(tail)), 0, -1):
        if tail.endswith(tag[:n]):
            return n
    return 0


def _single_token_id(tokenizer, token: str) -> int | None:
    """The id of ``token`` if the tokenizer has it as one token. Looked up token by token: a
    parser is made per request, and copying a 150k-entry vocabulary each time would cost more
    than the parsing."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "convert_tokens_to_ids"):  # transformers
        token_id = tokenizer.convert_tokens_to_ids(token)
        # An unknown token maps to the unknown token's id (or None), not to an error.
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            return None
        return token_id
    return tokenizer.token_to_id(token)  # a bare tokenizers.Tokenizer


class ReasoningParser:
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer):
        ids = {t: _single_token_id(tokenizer, t) for t in (self.start_token, self.end_token)}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs the tokenizer to have {' and '.join(missing)} as single tokens"
            )
        self.start_token_id: int = ids[self.start_token]
        self.end_token_id: int = ids[self.end_token]
        self._text = ""
        self._pos = 0
        self._out = {_REASONING: [], _CONTENT: []}

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        return self.end_token_id in token_ids

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str) -> DeltaMessage | None:
        self._text = current_text
        self._advance(final=False)
        return self._take_delta()

    def finish_streaming(self) -> DeltaMessage | None:
        """What was held back, once the output has ended (call after the last delta)."""
        self._advance(final=True)
        return self._take_delta()

    # -- for the formats ----------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _until_tag(self, tag: str, kind: str, final: bool) -> bool:
        """Send ``text[pos:]`` as ``kind`` up to ``tag``; True (and past the tag) once it is found."""
        found = self._text.find(tag, self._pos)
        if found >= 0:
            self._send(kind, found)
            self._pos = found + len(tag)
            return True
        hold = 0 if final else _tag_prefix_len(self._text, self._pos, tag)
        self._send(kind, len(self._text) - hold)
        return False

    def _send(self, kind: str, end: int) -> None:
        if end > self._pos:
            self._out[kind].append(self._text[self._pos : end])
            self._pos = end

    def _take_delta(self) -> DeltaMessage | None:
        reasoning = "".join(self._out[_REASONING])
        content = "".join(self._out[_CONTENT])
        self._out[_REASONING].clear()
        self._out[_CONTENT].clear()
        if not reasoning and not content:
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None)
