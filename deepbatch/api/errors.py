"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}`` with a string code.

Every failure the server answers goes through here, so a client never sees FastAPI's 422 or a
bare 500. Messages that may echo client input are capped, so a huge bad field cannot make a huge
error reply.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepbatch.api.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 512

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = "invalid_value",
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers


def cap(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    message = message if len(message) <= limit else message[: limit - 15] + "... (truncated)"
    # An echoed input may hold a lone surrogate, which the UTF-8 reply body cannot carry.
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(error: APIError) -> dict:
    param = None if error.param is None else cap(error.param, 256)
    info = ErrorInfo(message=cap(error.message), type=error.type, param=param, code=error.code)
    return ErrorResponse(error=info).model_dump()


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first schema error, named by its field path (no input values: they may be huge)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    ctx = first.get("ctx") or {}
    if isinstance(ctx.get("param"), str):  # a whole-request check that names the field itself
        return bad_request(first.get("msg", "invalid value"), param=ctx["param"],
                           code=first.get("type", "invalid_value"))
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Union members show up as loc entries like "list[int]"; they name types, not fields.
    fields = [p for p in loc if not any(c in p for c in "[]|")]
    param = fields[0] if fields else None
    kind = first.get("type", "")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    if kind == "missing":
        code = "missing_required_parameter"
    if kind == "extra_forbidden":
        where = ".".join(loc) or "body"
        return bad_request(f"{where}: unrecognized request argument; this server does not implement it",
                           param=loc[0] if loc else None, code="unknown_parameter")
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    where = ".".join(fields) or "body"
    return bad_request(f"{where}: {msg}", param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))


class ContainErrors:
    """The outermost ASGI layer. Starlette sends the 500 reply for an unexpected exception and
    then re-raises it for the server to log; uvicorn then drops the client's keep-alive
    connection, so the client's next request on it fails too. The exception was logged by the
    500 handler already: here it stops. One that escapes before any reply gets the 500 here."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            if not started:
                logger.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
                error = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
                await error_response(error)(scope, receive, send)
