"""Fuzz every route from /openapi.json with schemathesis (bodies that fit the schema and bodies
that do not) against the real app over a fake engine, so thousands of inputs cost seconds: no
input may get a 5xx or FastAPI's 422, and every error is an OpenAI error body."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from apitest_fakes import FakeEngine  # noqa: E402
from deepbatch.api.server import ServerConfig, build_app  # noqa: E402
from deepbatch.engine.async_engine import AsyncEngine  # noqa: E402

_engine = AsyncEngine(FakeEngine(max_model_len=64))
_app = build_app(_engine, ServerConfig(log_stats_interval=0))
_engine.start()


async def _app_without_lifespan(scope, receive, send):
    """The test client runs the lifespan around every call, and shutting down is once per engine."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await _app(scope, receive, send)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app_without_lifespan)
schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=40)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call()
    assert response.status_code < 500 and response.status_code != 422, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)
