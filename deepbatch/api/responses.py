"""Engine outputs shaped as OpenAI replies: usage, logprobs in the completions and chat formats,
and for streaming the per-choice deltas and their SSE events.

Outputs from the engine are cumulative; streaming turns them into per-choice deltas. While a
choice with stop strings is running, the last ``len(longest stop) - 1`` characters are held back:
they may turn out to be the start of a stop string that the final text drops, and a streamed
character cannot be taken back.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
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
    parser: Any = None  # the choice's ChoiceParser, if its text is parsed


def include_usage(req: SamplingRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def hold(params: SamplingParams) -> int:
    return max(len(s) for s in params.stop) - 1 if params.stop else 0


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
        lp = CompletionLogProbs()
        for tok, (logprob, top) in zip(token_ids, logprobs):
            text = self.token_text(tok)
            lp.tokens.append(text)
            logprob = _finite(logprob)
            lp.token_logprobs.append(logprob)
            alternatives = {self.token_text(t): _finite(v) for t, v in top.items()}
            alternatives.setdefault(text, logprob)  # the sampled token is always listed (OpenAI legacy)
            lp.top_logprobs.append(alternatives)
            lp.text_offset.append(text_offset)
            text_offset += len(text)
        return lp

    def prompt_logprobs(self, out: RequestOutput) -> PromptLogprobs | None:
        """``out.prompt_logprobs`` in vLLM's JSON shape, each token's text in ``decoded_token``."""
        if out.prompt_logprobs is None:
            return None
        return [None if position is None else {
            str(t): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self.token_text(t))
            for t, lp in position.items()} for position in out.prompt_logprobs]

    def chat_logprobs(self, token_ids, logprobs, top_n: int) -> ChatChoiceLogProbs:
        content = []
        for tok, (logprob, top) in zip(token_ids, logprobs):
            text = self.token_text(tok)
            alternatives = sorted(top.items(), key=lambda kv: -kv[1])[:top_n]
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
        prefix = ""
        if spec.echo and st.text_len == 0 and st.num_tokens == 0:
            prefix = self.prompt_text(out)
        end = len(c.text) if c.finished else max(st.text_len, len(c.text) - spec.hold)
        text = c.text[st.text_len:end]
        new_tokens = c.token_ids[st.num_tokens:]
        new_logprobs = c.logprobs[st.num_tokens:] if c.logprobs is not None else None
        # A chunk per step that produced tokens, even when no text is ready yet (held back for a
        # stop string, an incomplete character, a model without a tokenizer): clients time
        # tokens by chunks, as with vLLM.
        if not text and not prefix and not c.finished and not new_tokens:
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
            lp = self.completion_logprobs(new_tokens, new_logprobs, offset + len(prefix))
        return CompletionChoice(index=index, text=prefix + text, logprobs=lp, finish_reason=reason,
                                stop_reason=c.stop_reason if c.finished else None)


def usage(outs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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
