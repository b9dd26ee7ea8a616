"""The OpenAPI document: each route's error replies with the OpenAI error body, the health
reply, and the request bodies that the routes parse by hand (so that they answer 400, never
FastAPI's 422) put back into the document for clients and fuzzers."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel

from deepbatch.api.protocol import ErrorResponse


class HealthStatus(BaseModel):
    """``ok`` (200): serving. ``draining`` (503): shutting down, finishing in-flight requests.
    ``dead`` (503): a model step failed; ``error`` says why and the process is about to exit."""

    status: Literal["ok", "draining", "dead"]
    error: str | None = None


_ERROR_MEANINGS = {
    400: "Invalid request: a field, the JSON body, or a prompt that does not fit the context",
    401: "Missing or unknown API key (send Authorization: Bearer <key>)",
    403: "The API key may not ask for this priority (its priority_ceiling)",
    404: "Unknown model, or the feature is off",
    413: "The request body is over the size limit",
    429: "Too many requests: the waiting queue is full, or the API key's max_concurrent is reached; see Retry-After",
    500: "The engine failed while running the request",
    503: "The server is draining for shutdown, or its engine is dead; retry on another replica",
}


def error_responses(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _ERROR_MEANINGS[s]} for s in statuses if s}


# OpenAPI 3.1 reads an event stream's `schema` as the shape of each event (3.2 names it
# `itemSchema`): one `data` line holding a JSON chunk, or the closing `[DONE]`.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "A JSON chunk object, or [DONE] after the last one"},
        "event": {"type": "string", "enum": ["message"]},
    },
}


def request_body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_request_schemas(app: FastAPI, models: list) -> None:
    """Bodies are parsed by hand (to answer 400, never 422), so FastAPI does not see their models;
    put them into the OpenAPI document for clients and fuzzers."""
    base = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                s = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(s.pop("$defs", {}))
                components[model.__name__] = s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def generation_reply(model) -> dict:
    return {200: {"model": model, "description": "The reply; with stream=true, server-sent events of chunks, "
                                                 "then 'data: [DONE]'",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}

