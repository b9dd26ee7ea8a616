"""How the errors of a completion or chat request become OpenAI error answers: those raised while
the request is accepted (``engine_error``: 400, 429 with Retry-After, 503), those after
(``request_failure``: the engine died or stopped, an internal error), and a request the engine
ended with an error of its own (``output_error``)."""

from __future__ import annotations

import logging
import math

from deepbatch.api.errors import APIError
from deepbatch.core.errors import EngineDeadError, InvalidRequestError
from deepbatch.core.outputs import RequestOutput
from deepbatch.engine.admission import QueueFullError
from deepbatch.engine.engine_client import EngineClient, EngineDrainingError

logger = logging.getLogger("deepbatch.api.serving")

# The engine error about a request id can only come from a client-chosen one.
_ID_ALIAS = {"request_id": "X-Request-Id"}


def engine_error(e: Exception, param_alias: dict[str, str] | None = None) -> APIError:
    """The HTTP answer to an error raised while accepting a request."""
    if isinstance(e, InvalidRequestError):
        param = _renamed(e.param, {**_ID_ALIAS, **(param_alias or {})})
        message = e.message
        if param != e.param and message.startswith(f"{e.param}: "):
            message = f"{param}: {message[len(e.param) + 2:]}"
        return APIError(400, message, param=param, code=e.code)
    if isinstance(e, QueueFullError):
        retry_after = max(1, math.ceil(e.retry_after))
        return APIError(429, str(e), code="queue_full", headers={"Retry-After": str(retry_after)})
    if isinstance(e, EngineDrainingError):
        return APIError(503, str(e), code="server_draining")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    raise e


def _renamed(param: str | None, aliases: dict[str, str]) -> str | None:
    """``param`` under the client's name: an alias of it or of the field it is inside."""
    if param is None:
        return None
    for engine_name, client_name in aliases.items():
        if param == engine_name or param.startswith((f"{engine_name}.", f"{engine_name}[")):
            return client_name
    return param


def request_failure(e: Exception, engine: EngineClient) -> APIError:
    """The answer to a request that failed after it was accepted."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        if not engine.is_dead:  # stopped, not failed: a second signal cut the drain short
            return APIError(503, "the server shut down before this request finished; retry on another replica",
                            code="server_shutdown")
        return APIError(500, str(e), code="engine_dead")
    if isinstance(e, InvalidRequestError):  # refused by the engine thread's own checks
        return engine_error(e)
    logger.error("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")


def output_error(out: RequestOutput) -> APIError:
    """A request that failed in the engine: a 400 where its own input was at fault (a grammar its
    model cannot complete), else a 500."""
    if out.error_code == "invalid_grammar":
        return APIError(400, out.error, code=out.error_code)
    return APIError(500, out.error, code="request_failed")
