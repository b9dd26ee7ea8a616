"""One chat choice's output split into reasoning, content and tool calls, whole or as stream
deltas.

The reasoning parser (``--reasoning-parser``) runs first: what it calls content goes on to the
tool-call step, which depends on the request's ``ToolPlan``: the ``--tool-call-parser`` for
``auto``, the constrained JSON read by the server for ``required`` and a named function, or
nothing. Parsers keep state per choice, so each choice gets its own ``ChoiceParser``.

Parsers read text decoded with special tokens kept (their markers may be special tokens), so the
end-of-sequence token's text is cut from an output that ended on it before anything reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deepbatch.api.protocol import (
    ChatResponseMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCallOut, ToolCallOut,
)
from deepbatch.api.serving_tools import ToolPlan, tool_call_id
from deepbatch.api.tool_call_json import ToolCallArrayScanner
from deepbatch.core.outputs import CompletionOutput


@dataclass(frozen=True)
class ParserConfig:
    """The server's parsers (classes from the registries; one instance per choice)."""

    tool_parser: type | None = None  # with --enable-auto-tool-choice
    reasoning_parser: type | None = None


def check_parser_flags(tool_call_parser: str | None, reasoning_parser: str | None,
                       enable_auto_tool_choice: bool) -> tuple[type | None, type | None]:
    """The parser classes by vLLM's names; ValueError for an unknown name or for auto tool
    choice without a tool-call parser."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    tool_cls = reasoning_cls = None
    if tool_call_parser:
        from deepbatch.api.tool_parsers import get_tool_parser

        tool_cls = get_tool_parser(tool_call_parser)
    if reasoning_parser:
        from deepbatch.api.reasoning import get_reasoning_parser

        reasoning_cls = get_reasoning_parser(reasoning_parser)
    return tool_cls, reasoning_cls


def load_parsers(tool_call_parser: str | None, reasoning_parser: str | None, enable_auto_tool_choice: bool,
                 tokenizer) -> ParserConfig:
    """``check_parser_flags``, and each parser tried on the model's tokenizer (ValueError for a
    tokenizer without a parser's markers)."""
    tool_cls, reasoning_cls = check_parser_flags(tool_call_parser, reasoning_parser, enable_auto_tool_choice)
    if (tool_cls is not None or reasoning_cls is not None) and tokenizer is None:
        raise ValueError("--tool-call-parser and --reasoning-parser need a model with a tokenizer")
    # A tokenizer without a parser's markers fails now, not on every request.
    for flag, cls in (("--reasoning-parser", reasoning_cls), ("--tool-call-parser", tool_cls)):
        if cls is not None:
            try:
                cls(tokenizer)
            except Exception as e:  # any refusal is a start-up error with the flag named
                raise ValueError(f"{flag}: {e}") from e
    return ParserConfig(tool_cls if enable_auto_tool_choice else None, reasoning_cls)


def strip_eos(c: CompletionOutput, eos_token_ids, token_text) -> CompletionOutput:
    """``c`` without the end-of-sequence token's text at its end (kept there by decoding with
    special tokens)."""
    if not (c.finish_reason == "stop" and c.stop_reason is None and c.token_ids and c.token_ids[-1] in eos_token_ids):
        return c
    tail = token_text(c.token_ids[-1])
    if tail and c.text.endswith(tail):
        return replace(c, text=c.text[: -len(tail)])
    return c


def reasoning_open(prompt_ids: list[int], end_token_id: int, decode) -> bool:
    """Whether the model starts inside its reasoning: unless the prompt itself ends by closing it
    (Qwen3 with thinking off renders an empty ``<think></think>``), the grammar of a structured
    output waits for the end-of-thinking token in the output."""
    for i in range(len(prompt_ids) - 1, -1, -1):
        if prompt_ids[i] == end_token_id:
            return bool(decode(prompt_ids[i + 1:]).strip())
    return True


def reply_message(c: CompletionOutput, parser: ChoiceParser | None) -> tuple[ChatResponseMessage, str | None]:
    """A whole reply's message and finish reason for choice ``c``, parsed when ``parser`` is given."""
    if parser is None:
        return ChatResponseMessage(content=c.text), c.finish_reason
    parsed = parser.parse(c.text)
    message = ChatResponseMessage(content=parsed.content, reasoning_content=parsed.reasoning,
                                  tool_calls=parsed.tool_calls or None)
    return message, parser.finish_reason(c.finish_reason)


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCallOut] = field(default_factory=list)


class ChoiceParser:
    def __init__(self, plan: ToolPlan, config: ParserConfig, tokenizer):
        self.plan = plan
        self.reasoning = config.reasoning_parser(tokenizer) if config.reasoning_parser is not None else None
        self.tools = config.tool_parser(tokenizer) if plan.mode == "auto" else None
        self.scanner = ToolCallArrayScanner() if plan.mode == "required" else None
        self.text = ""
        self.content = ""
        self.called = False  # a tool call was returned or streamed
        self._sent: dict[int, int] = {}  # required / named: call index -> argument chars sent

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason

    # -- whole replies ---------------------------------------------------------------------------

    def parse(self, text: str) -> ParsedChoice:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        calls: list[ToolCallOut] = []
        mode = self.plan.mode
        if mode == "auto" and content:
            found = self.tools.extract_tool_calls(content)
            if found.tools_called:
                calls = [_call(c.id or tool_call_id(), c.name, c.arguments) for c in found.tool_calls]
                content = found.content if found.content and found.content.strip() else None
        elif mode == "named" and content:
            calls, content = [_call(tool_call_id(), self.plan.function, content)], None
        elif mode == "required":
            # The grammar allows nothing but calls; a cut-off output keeps the calls begun.
            scanner = ToolCallArrayScanner()
            scanner.feed(content or "")
            calls = [_call(tool_call_id(), c.name, scanner.arguments(c)) for c in scanner.calls if c.name is not None]
            content = None
        if not self.plan.parallel:
            calls = calls[:1]
        self.called = bool(calls)
        return ParsedChoice(reasoning, content, calls)

    # -- streams ---------------------------------------------------------------------------------

    def delta(self, delta_text: str, final: bool = False) -> DeltaMessage | None:
        """What ``delta_text`` (the next piece of the output) adds; None while parsers hold it.
        ``final``: the output has ended, so what the parsers still hold goes out."""
        previous, self.text = self.text, self.text + delta_text
        out = DeltaMessage()
        if self.reasoning is not None:
            found = [self.reasoning.extract_reasoning_streaming(previous, self.text, delta_text)] if delta_text else []
            if final:
                found.append(self.reasoning.finish_streaming())
            for part in found:
                if part is not None:
                    out.reasoning_content = _joined(out.reasoning_content, part.reasoning_content)
                    if part.content:
                        self._content_delta(part.content, out)
        elif delta_text:
            self._content_delta(delta_text, out)
        if final and self.tools is not None:
            self._add_parsed(self.tools.finish_streaming(), out)
        if out.reasoning_content is None and out.content is None and not out.tool_calls:
            return None
        return out

    def _content_delta(self, delta: str, out: DeltaMessage) -> None:
        previous, self.content = self.content, self.content + delta
        mode = self.plan.mode
        if mode == "auto":
            self._add_parsed(self.tools.extract_tool_calls_streaming(previous, self.content, delta), out)
            return
        if mode == "named":
            calls = [self._fragment(0, self.plan.function, self.content)]
        elif mode == "required":
            self.scanner.feed(delta)
            calls = [self._fragment(i, c.name, self.scanner.arguments(c))
                     for i, c in enumerate(self.scanner.calls) if c.name is not None]
        else:
            out.content = _joined(out.content, delta)
            return
        self._add_calls([c for c in calls if c is not None], out)

    def _add_parsed(self, found, out: DeltaMessage) -> None:
        """A tool-call parser's DeltaMessage into ``out``."""
        if found is not None:
            out.content = _joined(out.content, found.content)
            self._add_calls([_delta_call(c) for c in found.tool_calls], out)

    def _add_calls(self, calls: list[DeltaToolCall], out: DeltaMessage) -> None:
        if not self.plan.parallel:
            calls = [c for c in calls if c.index == 0]
        if calls:
            self.called = True
            out.tool_calls = (out.tool_calls or []) + calls

    def _fragment(self, index: int, name: str, arguments: str) -> DeltaToolCall | None:
        """The arguments of call ``index`` past what was sent; the first delta names the call."""
        sent = self._sent.get(index)
        if sent is None:
            self._sent[index] = len(arguments)
            return DeltaToolCall(index=index, id=tool_call_id(), type="function",
                                 function=DeltaFunctionCall(name=name, arguments=arguments))
        if len(arguments) == sent:
            return None
        self._sent[index] = len(arguments)
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments[sent:]))


def _joined(a: str | None, b: str | None) -> str | None:
    return (a or "") + b if b else a


def _call(id_: str, name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(id=id_, function=FunctionCallOut(name=name, arguments=arguments))


def _delta_call(c) -> DeltaToolCall:
    """A parser's ``DeltaToolCall`` in the wire shape."""
    function = None
    if c.name is not None or c.arguments is not None:
        function = DeltaFunctionCall(name=c.name, arguments=c.arguments)
    return DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None, function=function)
