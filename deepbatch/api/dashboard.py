"""The live dashboard at ``/dashboard``: one page, served by the server itself, that polls the
server's own JSON every second and draws it with the vendored uPlot (``static/vendor/uplot``).
Nothing is fetched from outside the server.

    GET /dashboard                  the page             static, no API key (see _StaticFiles)
    GET /dashboard/static/<file>    its script, styles, the chart library
    GET /stats                      queue, KV usage and fragmentation    API key when keys are on
    GET /dashboard/stats            token counters, TTFT/TPOT p50/p99, tenant shares     "
    GET /v1/controller              the SLO controller (polled only while it is on)      "
    GET /health                     live, draining or dead                               no key

``/dashboard/stats`` carries what ``/stats`` does not: the engine's cumulative token counters
with the server's clock (the page turns successive samples into tokens/s), the request-level
window of ``dashboard_stats.py``, and an id that changes when the server restarts, so the page
never takes the drop of a counter across a restart for a rate.
"""

from __future__ import annotations

import logging
import mimetypes
import secrets
import time
from pathlib import Path

from fastapi import FastAPI

from deepbatch.api.dashboard_stats import DashboardStats

logger = logging.getLogger("deepbatch.server")

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_PATH = "/dashboard"
STATIC_PREFIX = "/dashboard/static/"

# The page runs only its own files and talks only to its own server.
_SECURITY_HEADERS = [
    (b"content-security-policy",
     (b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
      b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'")),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    # Revalidated on every load, so a restarted (or upgraded) server's page is the one shown.
    (b"cache-control", b"no-cache"),
]
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}


def static_routes(static_dir: Path = STATIC_DIR) -> dict[str, Path]:
    """URL path -> file: the page and every file under ``static_dir``, listed once. Requests are
    looked up in this table, never joined onto the directory, so no path can reach outside it."""
    routes = {}
    for f in sorted(static_dir.rglob("*")):
        if f.is_file():
            name = f.relative_to(static_dir).as_posix()
            routes[PAGE_PATH if name == "dashboard.html" else STATIC_PREFIX + name] = f
    return routes


def _load(routes: dict[str, Path]) -> dict[str, tuple[bytes, str]]:
    """URL path -> (bytes, media type), read once: about 80 KB in all."""
    files = {}
    for path, f in routes.items():
        media = _TYPES.get(f.suffix) or mimetypes.guess_type(f.name)[0] or "application/octet-stream"
        files[path] = (f.read_bytes(), media)
    return files


class _StaticFiles:
    """Pure-ASGI layer, outside the API-key gate, answering GET and HEAD for the dashboard's
    static files. They hold no data (the page asks for a key and sends it with each poll), and a
    browser cannot put an ``Authorization`` header on a page load, so they must be reachable
    without a key. Anything else passes through to the gate and the routes untouched."""

    def __init__(self, app, files: dict[str, tuple[bytes, str]]):
        self.app = app
        self.files = files

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] not in ("GET", "HEAD")
                or scope["path"] not in self.files):
            return await self.app(scope, receive, send)
        body, media = self.files[scope["path"]]
        headers = [(b"content-type", media.encode()), (b"content-length", str(len(body)).encode()),
                   *_SECURITY_HEADERS]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


def install_dashboard(app: FastAPI) -> None:
    """Serve the page and add ``GET /dashboard/stats``, reading ``app.state.engine``. Call after
    the API-key gate is added: the static layer must wrap it (the last middleware added is the
    outermost)."""
    engine = app.state.engine
    window = DashboardStats()
    engine.add_observer(window.observe)
    server_id = secrets.token_hex(8)
    model = getattr(engine, "model_name", None)
    files = _load(static_routes(STATIC_DIR))
    if PAGE_PATH not in files:  # a package built without its data files: the API still serves
        logger.warning("the dashboard's files are missing from %s; /dashboard is not served", STATIC_DIR)
    app.add_middleware(_StaticFiles, files=files)

    # Not in the OpenAPI document: the page's own data source, shaped for it, not an API.
    @app.get("/dashboard/stats", include_in_schema=False)
    async def dashboard_stats() -> dict:
        snap = engine.snapshot()
        return {
            "server_id": server_id,
            "model": model,
            "time": time.monotonic(),
            "num_prompt_tokens": snap.num_prompt_tokens,
            "num_generation_tokens": snap.num_generation_tokens,
            "num_steps": snap.num_steps,
            "controller": snap.controller is not None,
            **window.report(),
        }
