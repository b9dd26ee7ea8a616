"""An unexpected exception in a route is one 500 with the OpenAI error body; it goes no further
than the app, so the server keeps the client's connection."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI

from deepbatch.api.errors import ContainErrors, install_error_handlers

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise KeyError("a bug")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    return app


async def _get(app, *paths):
    transport = httpx.ASGITransport(app=app)  # raises what escapes the app, as uvicorn would see it
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return [await client.get(p) for p in paths]


def test_exception_escapes_starlette_without_the_layer():
    with pytest.raises(KeyError):
        asyncio.run(_get(_app(), "/boom"))


def test_exception_stops_at_the_layer():
    boom, fine = asyncio.run(_get(ContainErrors(_app()), "/boom", "/fine"))
    assert boom.status_code == 500
    assert boom.json()["error"]["code"] == "internal_error"
    assert fine.status_code == 200 and fine.json() == {"ok": True}
