"""OpenAI request and response schemas (pydantic v2), with vLLM's extra sampling fields.

Requests are strict: a string where a number belongs is a 400, not a silent coercion. Unknown
fields are ignored, as OpenAI clients send fields this server does not use (tools, metadata).
Every integer fits the type the engine keeps it in (a 70-bit ``top_k`` would wrap in a tensor),
every float is finite, and every string is encodable text: JSON may carry a lone UTF-16
surrogate (``"\\ud800"``) that no tokenizer, detokenizer or metrics label can take.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's own limit; also keeps one request from creating an unbounded number of sequences.
MAX_N = 128
MAX_LOGPROBS = 20

# Counts, ids and priorities end up in int32/int64 tensors or C loops. Ranges with a meaning
# (max_tokens >= 1, top_k == -1 or >= 1, ...) are SamplingParams' to check; this is the type.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
# The seeded sampler keys its noise by the full 64-bit seed.
Seed = Annotated[int, Field(ge=0, lt=2**64)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def unencodable_string(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` (models, dicts, lists;
    dict keys included) that is not encodable as UTF-8, or None. Iterative: bodies nest as deep
    as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(v, BaseModel):
            fields = {name: getattr(v, name) for name in type(v).model_fields}
            stack.append((where, {**fields, **(v.__pydantic_extra__ or {})}))
        elif isinstance(v, dict):
            for k, x in reversed(v.items()):
                key = f"{where}.{k}" if where else str(k)
                stack.append((key, x))
                stack.append((where or key, k))
        elif isinstance(v, (list, tuple)):
            # Token-id lists are the long ones: skip them in one C-level pass.
            if not set(map(type, v)) <= {int}:
                stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def check_encodable(model: BaseModel) -> None:
    where = unencodable_string(model)
    if where is not None:
        raise PydanticCustomError(
            "invalid_encoding", "{param}: the text is not valid Unicode (it holds a lone surrogate); send UTF-8",
            {"param": where})


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int32 = 0

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"must be an integer in [1, {MAX_N}]")
        return v

    @model_validator(mode="after")
    def _encodable(self):
        check_encodable(self)
        return self


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    ]})
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> PromptInput:
        """A string, a list of strings, a list of token ids or a list of token-id lists (bools are
        not token ids); emptiness is checked later, with the token count, by the engine."""
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v) or is_ids(v):
                return v
            if all(isinstance(p, list) for p in v) and all(is_ids(p) for p in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Other keys (reasoning_content, ...) pass through to the chat template.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers

    @model_validator(mode="after")
    def _role_fields(self):
        # OpenAI: only an assistant turn may omit content (it may hold just tool calls).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def to_template(self) -> dict:
        """The message as HF chat templates take it: content always a string (templates such as
        SmolLM2's concatenate it, and None or a missing key fails there), tool-call arguments
        as a mapping when they parse as one (templates render them with ``tojson``)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            msg["content"] = ""
        if self.tool_calls is not None:
            msg["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                          "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        return msg


def _arguments(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    # A "\ud800" escape inside the JSON text decodes to a lone surrogate: keep the text then.
    return value if isinstance(value, dict) and unencodable_string(value) is None else text


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# -- responses ------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTokenLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatTokenLogProb):
    top_logprobs: list[ChatTokenLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deepbatch"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorInfo
