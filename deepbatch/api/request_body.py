"""Reading a request body: bounded in bytes, strict JSON (no NaN or Infinity), a JSON object,
validated by the route's pydantic model, each failure the OpenAI error it deserves."""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import ValidationError

from deepbatch.api.errors import APIError, bad_request, from_validation_error


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_object(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 past ``limit`` bytes, 400 for anything but an object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_type")
    return body


def body_parser(max_request_body_bytes: int):
    """``parse(request, model)``: the body, validated by ``model`` (a pydantic model, or a function
    of the body that picks one); 413 past the limit, 400 for a body that does not validate."""

    async def parse(request: Request, model):
        body = await read_json_object(request, max_request_body_bytes)
        if not isinstance(model, type):
            model = model(body)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None

    return parse
