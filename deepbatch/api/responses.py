"""Engine outputs shaped as OpenAI replies: usage, logprobs in the completions and chat formats,
and for streaming the per-choice deltas and their SSE events.

Outputs from the engine are cumulative; streaming turns them into per-choice deltas. While a
choice with stop strings is running, the last ``len(longest stop) - 1`` characters are held back:
they may turn out to be the start of a stop string that the final text drops, and a streamed
character cannot be taken back.

With ``echo`` and ``logprobs`` a completion's logprobs cover the prompt tokens first (from the
engine's prompt logprobs: null for the first token, as OpenAI's legacy completions give it),
then the generated ones; a stream sends the prompt part whole, in its first chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from deepbatch.api.errors import APIError, error_body
from deepbatch.api.protocol import (
    ChatChoiceLogProbs, ChatLogProbsContent, ChatStreamChoice, ChatTokenLogProb, CompletionChoice, CompletionLogProbs,
    DeltaMessage, PromptLogprob, PromptLogprobs, PromptTokensDetails, SamplingRequest, UsageInfo,
)
from deepbatch.core.outputs import CompletionOutput, RequestOutput
from deepbatch.engine.request_stream import RequestStream
from deepbatch.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class StreamSpec:
    n: int
    include_usage: bool
    chat: bool
    echo: bool = False
    echo_logprobs: int | None = None  # with echo and logprobs: the k of the prompt tokens' alternatives
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    hold: int = 0  # characters held back while running (longest stop string - 1)
    top_logprobs: int = 0
    new_parser: Callable[[], Any] | None = None  # chat: a ChoiceParser per choice (chat_output)
    clean: Callable[[CompletionOutput], CompletionOutput] | None = None  # applied to each output first


@dataclass
class ChoiceState:
    """What has been streamed of one choice so far."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    echo_len: int | None = None  # with echo, once the prompt is sent: its length, where the text_offsets start
    parser: Any = None  # the choice's ChoiceParser, if its text is parsed


def include_usage(req: SamplingRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def hold(params: SamplingParams) -> int:
    return max(len(s) for s in params.stop) - 1 if params.stop else 0


def split_reasoning(choice):
    """``(reasoning part, the rest)`` of a chat stream choice whose text crossed the end of the
    reasoning (both fields in one delta), else ``(None, choice)``: the reasoning goes out in a
    chunk of its own first, so no delta mixes the two however many tokens a chunk carries."""
    delta = getattr(choice, "delta", None)
    if delta is None or not delta.reasoning_content or not (delta.content or delta.tool_calls):
        return None, choice
    head = ChatStreamChoice(index=choice.index, delta=DeltaMessage(role=delta.role,
                                                                   reasoning_content=delta.reasoning_content))
    rest = choice.model_copy(update={"delta": delta.model_copy(update={"role": None, "reasoning_content": None})})
    return head, rest


class ResponseFormatter:
    """The parts of a reply that need token text. Reads ``engine.tokenizer`` when it needs one;
    without a tokenizer a token's text is its id and a prompt's text is empty."""

    def __init__(self, engine):
        self.engine = engine
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.tokenizer
            text = tok.decode([token_id]) if tok is not None else str(token_id)
            self._token_text[token_id] = text
        return text

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        tok = self.engine.tokenizer
        return tok.decode(out.prompt_token_ids) if tok is not None else ""

    def completion_logprobs(self, token_ids, logprobs, text_offset: int) -> CompletionLogProbs:
        """``logprobs``: one ``{token_id: Logprob}`` per token (the token itself and its
        alternatives), or None for a token nothing was scored for (a prompt's first)."""
        lp = CompletionLogProbs()
        for tok, entry in zip(token_ids, logprobs):
            text = self.token_text(tok)
            lp.tokens.append(text)
            lp.text_offset.append(text_offset)
            text_offset += len(text)
            if entry is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            logprob = _finite(entry[tok].logprob)
            lp.token_logprobs.append(logprob)
            alternatives = {self.token_text(t): _finite(v.logprob) for t, v in entry.items()}
            alternatives.setdefault(text, logprob)  # the sampled token is always listed (OpenAI legacy)
            lp.top_logprobs.append(alternatives)
        return lp

    def echo_logprobs(self, out: RequestOutput, k: int, generated: CompletionLogProbs) -> CompletionLogProbs:
        """``generated`` (a choice's logprobs, offsets already past the echoed prompt) after the
        prompt's, whose offsets run from 0 and whose alternatives are the top ``k``."""
        positions = out.prompt_logprobs or []
        entries = [None if p is None else _top(p, tok, k) for tok, p in zip(out.prompt_token_ids, positions)]
        head = self.completion_logprobs(out.prompt_token_ids, entries, 0)
        return CompletionLogProbs(tokens=head.tokens + generated.tokens,
                                  token_logprobs=head.token_logprobs + generated.token_logprobs,
                                  top_logprobs=head.top_logprobs + generated.top_logprobs,
                                  text_offset=head.text_offset + generated.text_offset)

    def prompt_logprobs(self, out: RequestOutput, k: int | None = None) -> PromptLogprobs | None:
        """``out.prompt_logprobs`` in vLLM's JSON shape, each token's text in ``decoded_token``;
        with ``k``, only the top ``k`` alternatives (the engine may have scored more for echo)."""
        if out.prompt_logprobs is None:
            return None
        return [None if position is None else {
            str(t): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self.token_text(t))
            for t, lp in (position.items() if k is None else _top(position, tok, k).items())}
            for tok, position in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def chat_logprobs(self, token_ids, logprobs, top_n: int) -> ChatChoiceLogProbs:
        content = []
        for tok, entry in zip(token_ids, logprobs):
            text = self.token_text(tok)
            logprob = entry[tok].logprob
            # the most likely top_n (the entry also holds the sampled token, first)
            alternatives = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: -kv[1])[:top_n]
            content.append(ChatLogProbsContent(
                token=text, logprob=_finite(logprob), bytes=list(text.encode()),
                top_logprobs=[ChatTokenLogProb(token=self.token_text(t), logprob=_finite(v),
                                               bytes=list(self.token_text(t).encode())) for t, v in alternatives]))
        return ChatChoiceLogProbs(content=content)

    def delta(self, out: RequestOutput, c: CompletionOutput, st: ChoiceState, index: int, spec: StreamSpec):
        """The stream choice for what ``c`` has added since ``st`` (which it advances); None
        when there is nothing to send yet."""
        if st.finished:
            return None
        prefix, echoing = "", spec.echo and st.echo_len is None
        if echoing:
            if spec.echo_logprobs is not None and not c.finished and not _prompt_scored(out):
                return None  # the prompt's logprobs go out whole, with the prompt
            prefix = self.prompt_text(out)
            st.echo_len = len(prefix)
        end = len(c.text) if c.finished else max(st.text_len, len(c.text) - spec.hold)
        text = c.text[st.text_len:end]
        new_tokens = c.token_ids[st.num_tokens:]
        new_logprobs = c.logprobs[st.num_tokens:] if c.logprobs is not None else None
        # A chunk per step that produced tokens, even when no text is ready yet (held back for a
        # stop string, an incomplete character, a model without a tokenizer): clients time
        # tokens by chunks, as with vLLM.
        if not text and not echoing and not c.finished and not new_tokens:
            return None
        offset = st.text_len
        st.text_len = max(st.text_len, end)
        st.num_tokens = len(c.token_ids)
        st.finished = c.finished
        reason = c.finish_reason if c.finished else None
        if spec.chat:
            lp = self.chat_logprobs(new_tokens, new_logprobs, spec.top_logprobs) if new_logprobs is not None else None
            if st.parser is not None:
                # While the parsers hold text back (a marker may be starting) the chunk is empty.
                delta = (st.parser.delta(text, final=c.finished) if text or c.finished else None) or DeltaMessage()
                reason = st.parser.finish_reason(reason)
            else:
                delta = DeltaMessage(content=text) if text or not c.finished else DeltaMessage()
            return ChatStreamChoice(index=index, delta=delta, logprobs=lp, finish_reason=reason,
                                    stop_reason=c.stop_reason if c.finished else None)
        lp = None
        if new_logprobs is not None:
            # Offsets index the text streamed so far, the echoed prompt included.
            lp = self.completion_logprobs(new_tokens, new_logprobs, offset + (st.echo_len or 0))
            if echoing and spec.echo_logprobs is not None:
                lp = self.echo_logprobs(out, spec.echo_logprobs, lp)
        return CompletionChoice(index=index, text=prefix + text, logprobs=lp, finish_reason=reason,
                                stop_reason=c.stop_reason if c.finished else None)


def usage(outs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def without_generation(out: RequestOutput) -> RequestOutput:
    """``out`` with its choices' generated tokens dropped: echo with ``max_tokens: 0`` asks for
    the prompt alone, but the engine always generates at least one token."""
    outputs = [replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [], stop_reason=None,
                       finish_reason=c.finish_reason if c.finish_reason in (None, "abort", "error") else "length")
               for c in out.outputs]
    return replace(out, outputs=outputs)


def _top(position: dict, token: int, k: int) -> dict:
    """A prompt position's entries (``{token_id: Logprob}``) cut to its prompt ``token`` and the
    top ``k``."""
    return {t: lp for t, lp in position.items() if t == token or (lp.rank is not None and lp.rank <= k)}


def _prompt_scored(out: RequestOutput) -> bool:
    return out.prompt_logprobs is not None and len(out.prompt_logprobs) >= len(out.prompt_token_ids)


def _finite(logprob: float) -> float:
    # Masked tokens (min_tokens, logit_bias) have -inf logprobs, which JSON cannot carry.
    return logprob if math.isfinite(logprob) else -9999.0


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Updates of several requests as (index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def sse(chunk) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error_body(error))}\n\n"
