"""API keys bound to tenants (``--api-keys-file``): the file format and its errors, the gate's
Bearer parsing, 401 with ``WWW-Authenticate``, the tenant and priority ceiling handed to the
routes, per-key in-flight limits, reload on SIGHUP, keys kept out of every log; and the OpenAPI
document, whose routes list the errors they answer (held to it by schemathesis)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest
import schemathesis
from fastapi import Request
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance

from apitest_fakes import FakeEngine
from apitest_server import LOG_DIR, MODEL, REPO, assert_error, free_port, get_server, httpx
from deepbatch.api.auth import KeyFileError, load_keys, parse_key_file
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.engine.async_engine import AsyncEngine

PLAIN_KEY = "sk-plain-auth-test"
KEYS_FILE = LOG_DIR / "api-keys.txt"
KEYS_TEXT = """\
# auth tests: key, tenant, settings
sk-acme-1      acme     priority_ceiling=0   # the urgent tenant
sk-two-2       limited  max_concurrent=2

sk-gone-3      gone
"""
KEYS_FILE.write_text(KEYS_TEXT)  # the server's; test_sighup_reloads_the_keys_file rewrites it
FIXED_KEYS_FILE = LOG_DIR / "api-keys-fixed.txt"  # the in-process apps'
FIXED_KEYS_FILE.write_text(KEYS_TEXT)
# Every secret any test sends, to look for in the logs at the end.
SENT_SECRETS = [PLAIN_KEY, "sk-acme-1", "sk-two-2", "sk-gone-3", "sk-new-4", "sk-wrong-5"]

SERVERS = {"keys": dict(args=["--num-gpu-blocks-override", "256", "--api-keys-file", str(KEYS_FILE)],
                        api_key=PLAIN_KEY)}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server():
    return get_server("keys")


# -- the file format ------------------------------------------------------------------------------


def test_key_file_entries():
    table = parse_key_file(KEYS_TEXT + "sk#hash   h   max_concurrent=1 priority_ceiling=-2\n", "k.txt", PLAIN_KEY)
    assert len(table) == 5
    _, acme = table.lookup(b"sk-acme-1")
    assert (acme.tenant, acme.max_priority, acme.max_concurrent, acme.source) == ("acme", 0, None, "k.txt:2")
    _, two = table.lookup(b"sk-two-2")
    assert (two.tenant, two.max_priority, two.max_concurrent) == ("limited", None, 2)
    _, hashed = table.lookup(b"sk#hash")  # '#' inside a key is not a comment
    assert (hashed.max_priority, hashed.max_concurrent) == (-2, 1)
    _, plain = table.lookup(PLAIN_KEY.encode())
    assert (plain.tenant, plain.max_priority, plain.max_concurrent) == (None, None, None)
    for wrong in (b"sk-acme-", b"sk-acme-1 ", b"acme", b"", b"#"):
        assert table.lookup(wrong) is None
    assert "sk-acme-1" not in repr(table) and PLAIN_KEY not in repr(table)
    assert load_keys(None, None) is None
    assert len(load_keys(None, PLAIN_KEY)) == 1


BAD_FILES = [
    # (text, line the error names, what it says)
    ("sk-a acme\nsk-lonely\n", 2, "expected 'KEY TENANT"),
    ("sk-a max_concurrent=2\n", 1, "expected 'KEY TENANT"),
    ("# c\n\nsk-a acme burst=3\n", 3, "unknown setting"),
    ("sk-a acme max_concurrent=two\n", 1, "must be an integer"),
    ("sk-a acme max_concurrent=0\n", 1, "at least 1"),
    ("sk-a acme priority_ceiling=1 priority_ceiling=2\n", 1, "given twice"),
    ("sk-a acme\nsk-b beta\nsk-a other\n", 3, "the same key as line 1"),
    (f"sk-a acme\n{PLAIN_KEY} other\n", 2, "also the --api-key"),
    ("sk-\u00e9 acme\n", 1, "printable ASCII"),
]


@pytest.mark.parametrize("text,line,message", BAD_FILES)
def test_bad_key_file_names_the_line_not_the_key(text, line, message):
    with pytest.raises(KeyFileError) as info:
        parse_key_file(text, "keys.txt", PLAIN_KEY)
    error = str(info.value)
    assert error.startswith(f"keys.txt:{line}: ") and message in error, error
    for secret in ("sk-a", "sk-b", "sk-lonely", PLAIN_KEY, "sk-\u00e9"):
        assert secret not in error


def test_serve_refuses_a_bad_key_file_before_loading_the_model(tmp_path):
    bad = tmp_path / "keys.txt"
    bad.write_text("sk-ok-1 acme\nsk-secret-9 acme priority_ceiling=high\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deepbatch.cli", "serve", "--port", str(free_port()),
                           "--api-keys-file", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{bad}:2: priority_ceiling must be an integer" in proc.stderr
    assert "sk-secret-9" not in proc.stderr + proc.stdout and "Loading weights" not in proc.stderr
    assert time.monotonic() - started < 60


# -- the gate, in process: what the routes are handed ----------------------------------------------


def test_gate_hands_the_tenant_and_ceiling_to_the_routes():
    app = build_app(AsyncEngine(FakeEngine()), ServerConfig(api_key=PLAIN_KEY, api_keys_file=str(FIXED_KEYS_FILE),
                                                             log_stats_interval=0))

    @app.get("/probe")
    async def probe(request: Request) -> dict:
        return {"tenant": request.state.tenant, "max_priority": request.state.max_priority}

    with TestClient(app) as client:
        assert client.get("/probe", headers=bearer("sk-acme-1")).json() == {"tenant": "acme", "max_priority": 0}
        assert client.get("/probe", headers=bearer("sk-two-2")).json() == {"tenant": "limited", "max_priority": None}
        # The plain --api-key binds no tenant: the body's user names it, as without a keys file.
        assert client.get("/probe", headers=bearer(PLAIN_KEY)).json() == {"tenant": None, "max_priority": None}
        assert_error(client.get("/probe", headers=bearer("sk-acme-2")), 401, None, "invalid_api_key")


# -- against the server ------------------------------------------------------------------------------


def raw_status(server, path: str, authorization: bytes) -> int:
    """The status of a GET whose Authorization line is sent byte for byte (HTTP clients refuse
    to send surrounding whitespace)."""
    request = (f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".encode()
               + b"Authorization:" + authorization + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        head = sock.recv(64)
    return int(head.split(b" ", 2)[1])


@pytest.mark.parametrize("header", [b"Bearer sk-acme-1", b"bearer sk-acme-1", b"BEARER sk-acme-1", b"bEaReR sk-acme-1",
                                    b"   Bearer   sk-acme-1  \t", b"Bearer\tsk-acme-1",
                                    f" Bearer {PLAIN_KEY}".encode()])
def test_bearer_scheme_in_any_case(server, header):
    assert raw_status(server, "/v1/models", header) == 200
    assert raw_status(server, "/v1/models", header.replace(b"sk-", b"sk-x")) == 401


@pytest.mark.parametrize("header", [None, "sk-acme-1", "Basic sk-acme-1", "Bearersk-acme-1", "Bearer",
                                    "Bearer sk-wrong-5", "Bearer sk-acme-1 extra", "Token sk-acme-1"])
def test_401_names_the_scheme(server, header):
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
        resp = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "x"}, timeout=30)
        assert_error(resp, 401, None, "invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health", headers=headers, timeout=30).status_code == 200


def test_every_key_generates(server):
    for key in ("sk-acme-1", "sk-two-2", PLAIN_KEY):
        resp = httpx.post(f"{server.url}/v1/completions", headers=bearer(key), timeout=60,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert resp.status_code == 200, resp.text


def test_the_key_names_the_tenant(server):
    def requests_of(tenant: str) -> float:
        return server.metric("deepbatch:tenant_requests_total", tenant=tenant)

    before = {t: requests_of(t) for t in ("acme", "mallory-t", "plain-user-t")}
    for key, user in (("sk-acme-1", "mallory-t"), ("sk-acme-1", None), (PLAIN_KEY, "plain-user-t")):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **({"user": user} if user else {})}
        resp = httpx.post(f"{server.url}/v1/completions", headers=bearer(key), json=body, timeout=60)
        assert resp.status_code == 200, resp.text
    # A bound key's tenant is who pays, whatever the body says; the plain key binds none.
    assert requests_of("acme") - before["acme"] == 2
    assert requests_of("mallory-t") == before["mallory-t"]
    assert requests_of("plain-user-t") - before["plain-user-t"] == 1


def test_the_priority_ceiling_reaches_the_routes(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    urgent = httpx.post(f"{server.url}/v1/completions", headers=bearer("sk-acme-1"), json={**body, "priority": -1},
                        timeout=60)
    assert_error(urgent, 403, "priority")
    for key, priority in (("sk-acme-1", 0), (PLAIN_KEY, -5), ("sk-two-2", -5)):
        resp = httpx.post(f"{server.url}/v1/completions", headers=bearer(key), json={**body, "priority": priority},
                          timeout=60)
        assert resp.status_code == 200, (key, resp.text)


def test_max_concurrent_per_key(server):
    completion = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True}

    async def run():
        async with server.async_http(headers=bearer("sk-two-2"), timeout=120) as client:
            first = asyncio.Event()

            async def long_stream():
                async with client.stream("POST", "/v1/completions",
                                         json={**completion, "max_tokens": 400, "stream": True}) as resp:
                    async for _ in resp.aiter_lines():
                        first.set()

            streams = [asyncio.ensure_future(long_stream()) for _ in range(2)]
            while not (first.is_set() and all(not s.done() for s in streams)):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # both are in flight
            resp = await client.post("/v1/completions", json={**completion, "max_tokens": 2})
            assert_error(resp, 429, None, "rate_limit_exceeded")
            assert resp.headers["retry-after"] == "1"
            assert_error(await client.get("/v1/models"), 429)  # every route counts
            other = await client.get("/v1/models", headers=bearer("sk-acme-1"))
            assert other.status_code == 200  # the limit is the key's, not the server's

            # A client that goes away frees its seat.
            streams[0].cancel()
            deadline = time.monotonic() + 10
            while (await client.get("/v1/models")).status_code != 200:
                assert time.monotonic() < deadline, "the disconnect did not free the seat"
                await asyncio.sleep(0.05)
            # One long stream still runs: a stream that ends (final body part written) frees its
            # seat, or the third of these would be refused.
            for _ in range(3):
                async with client.stream("POST", "/v1/completions",
                                         json={**completion, "max_tokens": 3, "stream": True}) as resp:
                    assert resp.status_code == 200
                    lines = [line async for line in resp.aiter_lines() if line]
                assert lines[-1] == "data: [DONE]"
            assert not streams[1].done()
            streams[1].cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    asyncio.run(run())


def wait_for_log(server, text: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log_tail(500_000):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{server.log_tail()}"
        time.sleep(0.05)


def models_status(server, key: str) -> int:
    return httpx.get(f"{server.url}/v1/models", headers=bearer(key), timeout=30).status_code


def test_sighup_reloads_the_keys_file(server):
    assert models_status(server, "sk-gone-3") == 200
    KEYS_FILE.write_text("sk-acme-1  acme  priority_ceiling=0\nsk-two-2  limited  max_concurrent=2\n"
                         "sk-new-4  newcomer\n")
    server.proc.send_signal(signal.SIGHUP)
    wait_for_log(server, "reloaded 4 API key(s)")
    assert models_status(server, "sk-new-4") == 200
    assert models_status(server, "sk-gone-3") == 401
    assert models_status(server, PLAIN_KEY) == 200  # --api-key stays beside the file

    # A reload that fails keeps the keys in force and names the line.
    KEYS_FILE.write_text("sk-acme-1  acme\nsk-new-4\n")
    server.proc.send_signal(signal.SIGHUP)
    wait_for_log(server, f"{KEYS_FILE}:2: expected 'KEY TENANT")
    assert "API keys not reloaded, the previous ones stay in force" in server.log_tail(500_000)
    assert models_status(server, "sk-new-4") == 200
    assert models_status(server, "sk-gone-3") == 401
    assert server.proc.poll() is None


def test_keys_are_never_logged(server):
    """After every test that sends keys (right and wrong) or reloads them."""
    httpx.get(f"{server.url}/v1/models?x=1", headers=bearer("sk-wrong-5"), timeout=30)
    log = server.log_tail(10_000_000)
    assert '"GET /v1/models?x=1 HTTP/1.1" 401' in log  # the access log is on
    for secret in SENT_SECRETS:
        assert secret not in log, secret


# -- the OpenAPI document ----------------------------------------------------------------------------

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def test_openapi_lists_each_routes_errors(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers=bearer("sk-acme-1"), timeout=30).json()
    schemas = doc["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    info = schemas["ErrorInfo"]
    assert set(info["properties"]) == {"message", "type", "param", "code"}
    assert set(info["required"]) == {"message", "type", "code"}
    assert {"CompletionRequest", "ChatCompletionRequest"} <= set(schemas)  # request bodies still there

    def errors(path: str, method: str) -> dict:
        responses = doc["paths"][path][method]["responses"]
        out = {}
        for status, spec in responses.items():
            if status.startswith(("4", "5")):
                out[int(status)] = spec["content"]["application/json"]["schema"]
        return out

    for path in ("/v1/completions", "/v1/chat/completions"):
        got = errors(path, "post")
        assert set(got) == {400, 401, 403, 404, 413, 429, 500, 503}, (path, set(got))
        assert all(schema == ERROR_REF for schema in got.values())
    assert set(errors("/v1/models", "get")) == {401, 429, 503}
    assert set(errors("/v1/controller", "get")) == {401, 404, 429, 503}
    for path in ("/metrics", "/stats", "/version"):
        assert set(errors(path, "get")) == {401, 429}, path
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HealthStatus"}
    assert "401" not in health


_fuzz_engine = AsyncEngine(FakeEngine(max_model_len=64))
_fuzz_app = build_app(_fuzz_engine, ServerConfig(api_key=PLAIN_KEY, api_keys_file=str(FIXED_KEYS_FILE),
                                                 log_stats_interval=0))
_fuzz_engine.start()


async def _fuzz_app_without_lifespan(scope, receive, send):
    """The test client runs the lifespan around every call, and shutting down is once per engine."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await _fuzz_app(scope, receive, send)


_schema = schemathesis.openapi.from_asgi("/openapi.json", _fuzz_app_without_lifespan, headers=bearer(PLAIN_KEY))
_schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=15)


@_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_replies_match_the_documented_responses(case):
    """Every status a route answers is documented for it, with the body schema it documents."""
    for headers in (bearer(PLAIN_KEY), {"Authorization": "Bearer sk-wrong-5"}):
        response = case.call(headers=headers)
        case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                  response_schema_conformance])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                              "stream": True}),
])
def test_a_stream_matches_the_documented_event_schema(path, body):
    """The fuzzer reaches a 200 stream only by chance; every streamed event must still fit the
    documented event shape (a schema that described the whole stream as one string once let every
    event fail validation)."""
    case = _schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call(headers=bearer(PLAIN_KEY))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")
    case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                              response_schema_conformance])
