"""The OpenAI completions and chat endpoints on top of an ``EngineClient``: a validated request
becomes sampling parameters and engine requests; their outputs are awaited (or streamed) and
become the reply, whose shape ``responses`` makes. Errors raised while accepting a request, and
after, become OpenAI error answers here.

Request ids are ``cmpl-<X-Request-Id>`` / ``chatcmpl-<X-Request-Id>`` when the client sends the
header (a random uuid otherwise). With an API-keys file the auth gate puts the key's tenant and
priority ceiling on the request's scope state; the tenant then replaces the body's ``user``.
With tracing on, what each engine request's span needs (the W3C trace context of the headers,
the sampling parameters) is handed to the tracer as the request is queued.

Chat replies go through a ``ChoiceParser`` per choice when the server has a reasoning parser or
the request calls tools (``chat_output``); output constraints come from ``structured`` and
``serving_tools``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepbatch.api import responses
from deepbatch.api.chat_output import ChoiceParser, ParserConfig, reasoning_open, reply_message, strip_eos
from deepbatch.api.errors import APIError, bad_request
from deepbatch.api.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, DeltaMessage,
    SamplingRequest,
)
from deepbatch.api.responses import ChoiceState, StreamSpec
from deepbatch.api.serving_errors import engine_error, output_error, request_failure
from deepbatch.api.serving_tools import ToolPlan, output_constraint, plan_tools
from deepbatch.api.sse import SSEResponse, run_until_disconnect
from deepbatch.api.structured import Constraint, param_alias, request_constraints, single, structured_outputs
from deepbatch.engine.engine_client import EngineClient
from deepbatch.engine.request_stream import RequestStream
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import RequestOutput
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.metrics.tracing import RequestTracer

logger = logging.getLogger(__name__)

# Arguments of the engine's apply_chat_template besides the template variables, and of HF's.
# chat_template_kwargs may not set them: they would collide with the call's own arguments, or
# change what it returns (tokenize, return_dict, ...) or which template runs (chat_template).
_TEMPLATE_CALL_ARGS = {"self", "messages", "conversation", "add_generation_prompt", "tokenize", "return_dict",
                       "return_tensors", "chat_template", "tokenizer_kwargs", "padding", "truncation", "max_length",
                       "return_assistant_tokens_mask", "sanitize_control_tokens"}
# HF arguments that are template inputs a client may set.
_TEMPLATE_INPUTS = {"tools", "documents", "continue_final_message"}

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: list[str], tracer: RequestTracer | None = None,
                 parsers: ParserConfig | None = None):
        self.engine = engine
        self.model_names = served_model_names
        self.tracer = tracer  # None: no spans
        self.vocab_size = engine.engine.hf_config.vocab_size
        self.formatter = responses.ResponseFormatter(engine)
        self.parsers = parsers or ParserConfig()
        # Only for the end-of-thinking token's id; each choice gets its own instance.
        self._reasoning = (self.parsers.reasoning_parser(engine.tokenizer)
                           if self.parsers.reasoning_parser is not None else None)
        self.eos_token_ids = frozenset(getattr(engine.engine, "eos_token_ids", None) or ())
        hf_args = _named_arguments(getattr(engine.tokenizer, "apply_chat_template", None))
        self._template_reserved = _TEMPLATE_CALL_ARGS | (hf_args - _TEMPLATE_INPUTS)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            raise APIError(404, f"the model {model!r} does not exist", param="model", code="model_not_found")

    def check_priority(self, req: SamplingRequest, raw: Request) -> None:
        """An API key's priority ceiling (set by the auth gate): lower values run first, so a
        request may not ask for a priority below it."""
        ceiling = getattr(raw.state, "max_priority", None)
        if ceiling is not None and req.priority < ceiling:
            raise APIError(403, f"priority {req.priority} is not allowed for this API key; the most urgent it may "
                           f"ask for is {ceiling}", param="priority", code="priority_not_allowed")

    @staticmethod
    def tenant(req: SamplingRequest, raw: Request) -> str:
        # A key's tenant is who pays; the body's user is then only the client's own label.
        return getattr(raw.state, "tenant", None) or req.user or "default"

    @staticmethod
    def request_id(prefix: str, raw: Request) -> str:
        given = raw.headers.get("x-request-id")
        if given is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if _REQUEST_ID.fullmatch(given) is None:
            raise bad_request("X-Request-Id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", "X-Request-Id")
        return f"{prefix}-{given}"

    def template_kwargs(self, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> dict:
        kwargs = req.chat_template_kwargs or {}
        reserved = sorted(k for k in kwargs if k in self._template_reserved)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (an argument of the "
                              "template call, not a template variable)", "chat_template_kwargs")
        if plan is not None and plan.template_tools:
            if "tools" in kwargs:
                raise bad_request("chat_template_kwargs may not set tools when the request sends tools",
                                  "chat_template_kwargs")
            kwargs = {**kwargs, "tools": plan.template_tools}
        return kwargs

    # -- requests -> engine ---------------------------------------------------------------------

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        param_alias: dict[str, str] | None = None, skip_special_tokens: bool | None = None
                        ) -> SamplingParams:
        bias = None
        if req.logit_bias is not None:
            bias = {}
            for key, value in req.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise bad_request(f"logit_bias: keys must be token ids, got {key[:32]!r}", "logit_bias") from None
                if not 0 <= token < self.vocab_size:
                    raise bad_request(f"logit_bias: token id {token} is outside [0, {self.vocab_size})", "logit_bias")
                bias[token] = value
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
                min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                logit_bias=bias,
            )
        except InvalidRequestError as e:
            raise engine_error(e, param_alias) from None

    @staticmethod
    def constrained(params: SamplingParams, constraint: Constraint | None,
                    start_after_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """``params`` with the output constraint, if there is one."""
        if constraint is None:
            return params
        try:
            return replace(params, structured_outputs=structured_outputs(constraint, start_after_token_ids))
        except InvalidRequestError as e:
            raise engine_error(e, param_alias(constraint)) from None

    async def _submit(self, request_id: str, prompts: list, params: SamplingParams, req: SamplingRequest,
                      raw: Request, param_alias: dict[str, str] | None = None) -> list[RequestStream]:
        pairs = [(request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt) for i, prompt in enumerate(prompts)]
        tracing = contextlib.nullcontext()
        if self.tracer is not None:
            tracing = self.tracer.pending(
                [rid for rid, _ in pairs], raw.headers, params,
                operation="chat" if isinstance(req, ChatCompletionRequest) else "text_completion",
                request_model=req.model or self.model_name, response_model=self.model_name, response_id=request_id)
        try:
            with tracing:
                # All or none: one bad prompt of several queues nothing.
                return await self.engine.add_requests(pairs, params, priority=req.priority,
                                                      tenant=self.tenant(req, raw), arrival_time=time.monotonic())
        except Exception as e:
            raise engine_error(e, param_alias) from None

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        request_id = self.request_id("cmpl", raw)
        self.check_priority(req, raw)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        _check_prompt_logprobs(req)
        # Echo with max_tokens 0 asks for the prompt alone (vLLM's and OpenAI's reading); the
        # engine generates one token, which the reply drops.
        prompt_only = req.echo and req.max_tokens == 0
        params = self.sampling_params(req, 1 if prompt_only else req.max_tokens, req.logprobs)
        echo_k = req.logprobs if req.echo else None  # the prompt's logprobs lead the choice's
        if echo_k is not None:
            params = replace(params, prompt_logprobs=max(echo_k, req.prompt_logprobs or 0))
        constraint = single(request_constraints(req))
        params = self.constrained(params, constraint)
        prompt = req.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        streams = await self._submit(request_id, prompts, params, req, raw, param_alias(constraint))
        if req.stream:
            spec = StreamSpec(req.n, responses.include_usage(req), chat=False, echo=req.echo, echo_logprobs=echo_k,
                              prompt_only=prompt_only, hold=responses.hold(params))
            return self._sse_response(request_id, streams, spec)
        outs = await self._final_outputs(streams, raw)
        if outs is None:
            return Response(status_code=499)
        if prompt_only:
            outs = [responses.without_generation(out) for out in outs]
        choices = []
        for i, out in enumerate(outs):
            prefix = self.formatter.prompt_text(out) if req.echo else ""
            # Each choice of a prompt repeats it, as vLLM's do; only when asked for by name.
            prompt_lp = (self.formatter.prompt_logprobs(out, req.prompt_logprobs)
                         if req.prompt_logprobs is not None else None)
            for c in out.outputs:
                lp = (self.formatter.completion_logprobs(c.token_ids, c.logprobs, len(prefix))
                      if c.logprobs is not None else None)
                if lp is not None and echo_k is not None:
                    lp = self.formatter.echo_logprobs(out, echo_k, lp)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_lp))
        resp = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=responses.usage(outs))
        return JSONResponse(resp.model_dump())

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        request_id = self.request_id("chatcmpl", raw)
        self.check_priority(req, raw)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        _check_prompt_logprobs(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # Name the field the client sent in errors about the engine's equivalent.
        alias = {"logprobs": "top_logprobs", "prompt": "messages"}
        if req.max_completion_tokens is not None:
            alias["max_tokens"] = "max_completion_tokens"
        plan = plan_tools(req, self.parsers.tool_parser is not None)
        constraint = output_constraint(req, plan)
        parsing = self._reasoning is not None or plan.calls_tools
        # Parsers' markers may be special tokens: they must survive decoding.
        keep_special = self._reasoning is not None or plan.mode == "auto"
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, alias,
                                      skip_special_tokens=False if keep_special else None)
        kwargs = self.template_kwargs(req, plan)
        try:
            ids = await self.engine.apply_chat_template(
                [m.to_template() for m in req.messages], add_generation_prompt=req.add_generation_prompt, **kwargs)
        except InvalidRequestError as e:
            raise engine_error(e) from None
        params = self.constrained(params, constraint, self._start_after(ids) if constraint is not None else ())
        alias.update(param_alias(constraint))
        streams = await self._submit(request_id, [{"prompt_token_ids": ids}], params, req, raw, alias)
        new_parser = (lambda: ChoiceParser(plan, self.parsers, self.engine.tokenizer)) if parsing else None
        clean = (lambda c: strip_eos(c, self.eos_token_ids, self.formatter.token_text)) if keep_special else None
        if req.stream:
            spec = StreamSpec(req.n, responses.include_usage(req), chat=True, hold=responses.hold(params),
                              top_logprobs=req.top_logprobs or 0, new_parser=new_parser, clean=clean)
            return self._sse_response(request_id, streams, spec)
        outs = await self._final_outputs(streams, raw)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for c in outs[0].outputs:
            c = clean(c) if clean is not None else c
            message, reason = reply_message(c, new_parser() if new_parser is not None else None)
            choices.append(ChatChoice(
                index=c.index, message=message,
                logprobs=self.formatter.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                if c.logprobs is not None else None,
                finish_reason=reason, stop_reason=c.stop_reason))
        resp = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=responses.usage(outs),
                                      prompt_logprobs=self.formatter.prompt_logprobs(outs[0]))
        return JSONResponse(resp.model_dump())

    def _start_after(self, prompt_ids: list[int]) -> tuple[int, ...]:
        """With a reasoning parser, a constraint applies from the end of thinking on."""
        if self._reasoning is None:
            return ()
        end = self._reasoning.end_token_id
        if reasoning_open(prompt_ids, end, self.engine.tokenizer.decode):
            return (end,)
        return ()

    # -- engine -> replies ----------------------------------------------------------------------

    async def _final_outputs(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput] | None:
        """Every request's final output; None if the client went away (its requests are aborted)."""
        try:
            outs = await run_until_disconnect(raw, asyncio.gather(*(s.result() for s in streams)))
        except Exception as e:
            raise request_failure(e, self.engine) from None
        finally:
            self._abort_unfinished(streams)
        if outs is not None:
            for out in outs:
                if out.error:
                    raise output_error(out)
        return outs

    async def _stream(self, request_id: str, streams: list[RequestStream], spec: StreamSpec) -> AsyncIterator[str]:
        created = int(time.time())
        states: dict[int, ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        chunk_cls = ChatCompletionChunk if spec.chat else CompletionChunk
        try:
            if spec.chat:
                first = [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(spec.n)]
                yield responses.sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                                        choices=first))
            async for i, out in responses.merge(streams):
                if out.error:
                    yield responses.sse_error(output_error(out))
                    break
                if spec.prompt_only:
                    out = responses.without_generation(out)
                if out.finished:
                    finals[i] = out
                heads, choices = [], []
                for c in out.outputs:
                    index = i * spec.n + c.index
                    state = states.get(index)
                    if state is None:
                        state = states[index] = ChoiceState(parser=spec.new_parser() if spec.new_parser else None)
                    if spec.clean is not None:
                        c = spec.clean(c)
                    choice = self.formatter.delta(out, c, state, index, spec)
                    if choice is not None:
                        head, choice = responses.split_reasoning(choice)
                        if head is not None:
                            heads.append(head)
                        choices.append(choice)
                if heads:
                    yield responses.sse(chunk_cls(id=request_id, created=created, model=self.model_name,
                                                  choices=heads))
                if choices:
                    yield responses.sse(chunk_cls(id=request_id, created=created, model=self.model_name,
                                                  choices=choices))
            else:
                if spec.include_usage:
                    usage = responses.usage(list(finals.values()))
                    yield responses.sse(chunk_cls(id=request_id, created=created, model=self.model_name, choices=[],
                                                  usage=usage))
        except Exception as e:  # the reply has started: the error goes into the stream, which still ends
            yield responses.sse_error(request_failure(e, self.engine))
        finally:
            self._abort_unfinished(streams)
        yield "data: [DONE]\n\n"

    def _sse_response(self, request_id: str, streams: list[RequestStream], spec: StreamSpec) -> SSEResponse:
        return SSEResponse(self._stream(request_id, streams, spec), on_close=lambda: self._abort_unfinished(streams))

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)


def _check_prompt_logprobs(req: SamplingRequest) -> None:
    # vLLM refuses them in streams too: they would all come before the first token anyway.
    # (Echo with logprobs streams: the prompt's logprobs come with the echoed prompt.)
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs")


def _named_arguments(fn) -> set[str]:
    """The names ``fn`` takes besides ``**kwargs``; empty when there is no ``fn``."""
    if fn is None:
        return set()
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
