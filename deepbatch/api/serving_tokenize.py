"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

    /tokenize    {"prompt": "...", "add_special_tokens": true}            -> {"count", "max_model_len",
                 {"messages": [...], "add_generation_prompt": true, "tools"}     "tokens", "token_strs"}
    /detokenize  {"tokens": [...]}                                        -> {"prompt": "..."}

Messages render through the same chat template call as ``/v1/chat/completions``, so ``tokens``
is exactly the prompt a chat request with those messages and tools would run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, model_validator

from deepbatch.api.errors import APIError, bad_request
from deepbatch.api.openapi import request_body
from deepbatch.api.protocol import ChatMessage, check_encodable
from deepbatch.api.protocol_base import Int32, _Request
from deepbatch.api.protocol_tools import ToolDefinition
from deepbatch.api.serving import OpenAIServing
from deepbatch.api.serving_errors import engine_error
from deepbatch.core.errors import InvalidRequestError


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _encodable(self):
        check_encodable(self)
        return self


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None

    @model_validator(mode="after")
    def _checks(self):
        check_encodable(self)
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int32]


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenize_routes(app: FastAPI, serving: OpenAIServing, parse, responses: dict) -> None:
    """``parse(request, model)``: the body validated by ``model`` or by the model that
    ``model(body)`` picks (with the server's size limit and 400s)."""
    engine = serving.engine

    async def in_thread(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def tokenizer():
        tok = engine.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer")
        return tok

    @app.post("/tokenize", response_model=TokenizeResponse, responses=responses, openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
            {"$ref": "#/components/schemas/TokenizeCompletionRequest"},
            {"$ref": "#/components/schemas/TokenizeChatRequest"}]}}}}})
    async def tokenize(request: Request) -> TokenizeResponse:
        req = await parse(request,
                          lambda body: TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest)
        serving.check_model(req.model)
        tok = tokenizer()
        if isinstance(req, TokenizeChatRequest):
            if req.add_special_tokens:
                raise bad_request("add_special_tokens: the chat template decides the special tokens",
                                  "add_special_tokens")
            kwargs = serving.template_kwargs(req)
            if req.tools:
                if "tools" in kwargs:
                    raise bad_request("chat_template_kwargs may not set tools when the request sends tools",
                                      "chat_template_kwargs")
                kwargs = {**kwargs, "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]}
            if req.continue_final_message:
                kwargs = {**kwargs, "continue_final_message": True}
            try:
                ids = await engine.apply_chat_template([m.to_template() for m in req.messages],
                                                       add_generation_prompt=req.add_generation_prompt, **kwargs)
            except InvalidRequestError as e:
                raise engine_error(e) from None
        else:
            ids = await in_thread(_encode, tok, req.prompt, req.add_special_tokens)
        strs = await in_thread(tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=responses,
              openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> DetokenizeResponse:
        req = await parse(request, DetokenizeRequest)
        serving.check_model(req.model)
        tok = tokenizer()
        bad = next((t for t in req.tokens if not 0 <= t < serving.vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside [0, {serving.vocab_size})", "tokens")
        try:
            text = await in_thread(tok.decode, req.tokens)
        except Exception as e:  # noqa: BLE001 - ids the tokenizer cannot decode are the client's input
            raise bad_request(f"tokens: cannot be decoded: {type(e).__name__}: {e}"[:300], "tokens") from None
        return DetokenizeResponse(prompt=text)


def _encode(tok, prompt: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tok.encode(prompt, add_special_tokens=add_special_tokens))
    except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's input
        raise APIError(400, f"prompt: cannot be tokenized: {type(e).__name__}: {e}"[:300], param="prompt") from None


TOKENIZE_MODELS = [TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest]
