"""OpenAI request and response schemas (pydantic v2), with vLLM's extra fields.

Every field a client may send is declared here: implemented, accepted as a hint the OpenAI API
defines (the chat request's hint fields), or refused with the reason (``*_UNSUPPORTED``).
Anything else is a 400 that names it (``protocol_base``). Requests are strict and their strings encodable; see
``protocol_base`` for the types the engine needs.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepbatch.api.protocol_base import (  # noqa: F401  (re-exported: the schemas' shared parts)
    MAX_LOGPROBS, MAX_N, Int32, Seed, _Request, check_encodable, refuse_unsupported, unencodable_string,
)
from deepbatch.api.protocol_responses import (  # noqa: F401  (re-exported: one module names every schema)
    PromptTokensDetails, UsageInfo, CompletionLogProbs, PromptLogprob, PromptLogprobs, CompletionChoice,
    CompletionResponse, ChatTokenLogProb, ChatLogProbsContent, ChatChoiceLogProbs, FunctionCallOut,
    ToolCallOut, ChatResponseMessage, ChatChoice, ChatCompletionResponse, DeltaFunctionCall, DeltaToolCall,
    DeltaMessage, ChatStreamChoice, ChatCompletionChunk, CompletionChunk, ModelCard, ModelList, ErrorInfo,
    ErrorResponse,
)
from deepbatch.api.protocol_tools import (
    JsonSchema, ResponseFormat, StructuredOutputsRequest, ToolChoice, ToolDefinition,
)

# Fields of the OpenAI API or of vLLM that this server knows and does not implement.
_COMMON_UNSUPPORTED = {
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "truncate_prompt_tokens": "prompts are never truncated; send a shorter one",
    "allowed_token_ids": "use logit_bias",
    "bad_words": "use logit_bias",
    "logits_processors": "custom logits processors are not implemented",
    "guided_whitespace_pattern": "use structured_outputs.disable_any_whitespace",
    "structural_tag": "structural tags are not implemented; use tools or a grammar",
    "return_tokens_as_token_ids": "not implemented",
    "return_token_ids": "not implemented",
    "spaces_between_special_tokens": "not implemented",
    "kv_transfer_params": "disaggregated prefill is not implemented",
    "vllm_xargs": "not implemented",
    "cache_salt": "not implemented",
    "request_id": "send the X-Request-Id header",
}
CHAT_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "functions": "deprecated by OpenAI; send tools",
    "function_call": "deprecated by OpenAI; send tool_choice",
    "audio": "this server generates text only",
    "reasoning_effort": "the served models take no reasoning effort",
    "verbosity": "the served models take no verbosity setting",
    "web_search_options": "web search is not implemented",
    "chat_template": "per-request templates are not accepted; start the server with --chat-template",
    "continue_final_message": "pass it in chat_template_kwargs",
    "documents": "pass them in chat_template_kwargs",
    "add_special_tokens": "the chat template decides the special tokens",
    "echo": "echo is a /v1/completions field",
    "mm_processor_kwargs": "this server takes text only",
}
COMPLETION_UNSUPPORTED = {**_COMMON_UNSUPPORTED, "add_special_tokens": "not implemented"}


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # a hint: this server pads no chunks


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
    # Per prompt token: its logprob and the top-k (vLLM's field; not with stream).
    prompt_logprobs: Int32 | None = None
    # Structured outputs: at most one of these (structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

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

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, COMPLETION_UNSUPPORTED)
        return data

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
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # without tools: a hint
    modalities: list[Literal["text"]] | None = None
    # Hints the OpenAI API defines (storage, billing tier, cache routing, abuse tracking, predicted
    # output for latency): accepted and not acted on, as the reply is the same without them.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, CHAT_UNSUPPORTED)
        return data
