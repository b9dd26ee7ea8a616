"""The checks in front of every route, before routing: API keys (the tenant and priority ceiling a
key binds, its in-flight limit), 503 on /v1 while draining or dead, and the count of replies not
yet written that a forced exit waits for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deepbatch.api.auth import KeyFileError, load_keys
from deepbatch.api.errors import APIError, error_response
from deepbatch.engine.engine_client import EngineClient

if TYPE_CHECKING:
    from deepbatch.api.server_config import ServerConfig, ServerState

logger = logging.getLogger("deepbatch.server")


def bearer_token(headers) -> bytes | None:
    """The credentials of ``Authorization: Bearer <token>`` (scheme in any case, surrounding
    whitespace ignored), else None."""
    raw = next((v for k, v in headers if k == b"authorization"), None)
    if raw is None:
        return None
    parts = raw.strip().split(None, 1)
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip()


class Gate:
    """Pure-ASGI checks before routing: API key on every route but /health and the dashboard's
    static files (those are answered before this gate, in ``api/dashboard.py``) (binding the request
    to the key's tenant and priority ceiling in ``scope["state"]``), the key's in-flight limit,
    and 503 on /v1 while draining or dead. It also counts replies not yet written, so a forced
    exit can wait for them. (Starlette's BaseHTTPMiddleware would hide client disconnects.)"""

    def __init__(self, app, engine: EngineClient, state: ServerState):
        self.app = app
        self.engine = engine
        self.state = state
        self.in_flight: dict[bytes, int] = {}  # key digest -> requests in flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error, key = self._admit(scope)
        if error is not None:
            return await error_response(error)(scope, receive, send)
        state = self.state
        state.open_requests += 1
        if key is not None:
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.open_requests -= 1
                if key is not None:
                    left = self.in_flight[key] - 1
                    if left:
                        self.in_flight[key] = left
                    else:
                        del self.in_flight[key]

        async def tracked_send(message) -> None:
            await send(message)
            # The last body part is written: the seat is free even if the app has more to do.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()

        try:
            await self.app(scope, receive, tracked_send)
        finally:  # a disconnect or an error: no final body part was sent
            release()

    def _admit(self, scope) -> tuple[APIError | None, bytes | None]:
        path = scope["path"]
        keys = self.state.keys
        digest = None
        if keys is not None and path != "/health":
            token = bearer_token(scope["headers"])
            found = keys.lookup(token) if token else None
            if found is None:
                return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"}), None
            digest, entry = found
            request_state = scope.setdefault("state", {})
            request_state["tenant"] = entry.tenant
            request_state["max_priority"] = entry.max_priority
        if path.startswith("/v1/") and (self.state.draining or self.engine.is_dead):
            code = "engine_dead" if self.engine.is_dead else "server_draining"
            return APIError(503, "the server is shutting down; retry on another replica", code=code), None
        if digest is not None:
            limit = entry.max_concurrent
            if limit is not None and self.in_flight.get(digest, 0) >= limit:
                return APIError(429, f"this API key already has {limit} request(s) in flight (its max_concurrent); "
                                     "retry when one finishes", code="rate_limit_exceeded",
                                headers={"Retry-After": "1"}), None
        return None, digest


def reload_keys(state: ServerState, config: ServerConfig) -> None:
    """Reread ``--api-keys-file``; a file that does not parse leaves the keys in force."""
    try:
        keys = load_keys(config.api_keys_file, config.api_key)
    except KeyFileError as e:
        logger.error("API keys not reloaded, the previous ones stay in force: %s", e)
        return
    state.keys = keys
    logger.info("reloaded %d API key(s) from %s", len(keys), config.api_keys_file)
