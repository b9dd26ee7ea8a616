"""Fuzz every route of /openapi.json with schemathesis against a real server process on the real
engine: bodies that fit the document and bodies that do not. No input gets a 5xx, bodies that
break the document are refused with a 4xx, every 4xx is an OpenAI error body, every 200 is a
well-formed reply, and replies are what the document declares (status codes, content types,
schemas).

Generated bodies keep their token limits small (``cap_cost``), so an accepted request costs a few
decode steps on a CPU.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance, negative_data_rejection, not_a_server_error, response_schema_conformance,
    status_code_conformance,
)

from apitest_hostile_bodies import CHAT, COMPLETIONS, HostileRequest
from apitest_hostile_checks import HOSTILE_SERVER, error_body_problem, live_server, reply_problem, stop_restarted
from apitest_server import MODEL

SERVERS = {"hostile": HOSTILE_SERVER}
MAX_EXAMPLES = 25
MAX_TOKENS = 4
MAX_N = 2
ROUTES = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def cap_cost(context, body):
    """The ``map_body`` hook: ``capped`` on a generated body."""
    return capped(body, context.operation.path if context.operation is not None else "")


def capped(body, path: str):
    """Generated token limits and n above a few are cut down, and a generated model name is the
    served one (else nearly every valid body would stop at the 404): valid values become other
    valid values. Values that break the document are left alone: they are what the negative
    cases test. Applied again before a valid case is sent (``cap_valid_body``): the coverage
    phase's bodies do not all pass through ``map_body``, and one without a cap asks for thousands
    of tokens."""
    if not isinstance(body, dict):
        return body
    for key, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("n", MAX_N),
                     ("best_of", MAX_N)):
        value = body.get(key)
        if _is_int(value) and value > cap:
            body[key] = cap
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    # No limit means "up to the context": ~500 decode steps.
    route = ROUTES.get(path)
    if route == CHAT and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_TOKENS
    elif route == COMPLETIONS and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    return body


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fold(value, lo: float, hi: float):
    """``value`` folded into [lo, hi] (a number the document allows but the server does not)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not lo <= value <= hi:
        return lo + abs(value) % (hi - lo) if abs(value) < 1e300 else lo
    return value


_FLOAT_RANGES = {"temperature": (0, 2), "top_p": (0.05, 1), "min_p": (0, 1), "presence_penalty": (-2, 2),
                 "frequency_penalty": (-2, 2), "repetition_penalty": (0.5, 2)}
_FEW_TOKEN_IDS = 1000  # token ids below this exist in any vocabulary the tests load


def cap_valid_body(case) -> None:
    """``capped`` once more on a body that fits the document, whatever phase made it (a negative
    case is left as generated: capping could make it valid)."""
    meta = case.meta
    if meta is None or meta.generation.mode == schemathesis.GenerationMode.POSITIVE:
        case.body = capped(case.body, case.operation.path)


def fit_fuzzed_body(case) -> None:
    """A fuzzed body that fits the document is moved into the ranges the server accepts, so it
    reaches the engine (the document states types, not ranges, and most random numbers are out
    of range). Coverage-phase and negative cases stay as generated."""
    body = case.body
    meta = case.meta
    if (not isinstance(body, dict) or meta is None or meta.phase.name != "fuzzing"
            or meta.generation.mode != schemathesis.GenerationMode.POSITIVE):
        return
    for key, (lo, hi) in _FLOAT_RANGES.items():
        if key in body:
            body[key] = _fold(body[key], lo, hi)
    if _is_int(body.get("top_k")) and body["top_k"] not in (-1, 0):
        body["top_k"] = 1 + abs(body["top_k"]) % 50
    elif "top_k" in body:
        body["top_k"] = None
    for key in ("logprobs", "top_logprobs"):
        if _is_int(body.get(key)):
            body[key] = abs(body[key]) % 6
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    body["n"] = _fold(body.get("n", 1), 1, MAX_N)
    if body.get("prompt") == "":
        body["prompt"] = "x"
    if _is_int(body.get("min_tokens")):
        body["min_tokens"] = min(abs(body["min_tokens"]), MAX_TOKENS)
    if _is_int(body.get("seed")):
        body["seed"] = abs(body["seed"]) % 2**64
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(i): _fold(v, -100, 100) for i, v in enumerate(body["logit_bias"].values())}
    if isinstance(body.get("stop_token_ids"), list):
        body["stop_token_ids"] = [abs(t) % _FEW_TOKEN_IDS for t in body["stop_token_ids"]]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        body["prompt"] = [abs(t) % _FEW_TOKEN_IDS for t in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        body["prompt"] = [[abs(t) % _FEW_TOKEN_IDS for t in p] or [1] for p in prompt]
    stop = body.get("stop")
    if stop == "" or (isinstance(stop, list) and "" in stop):
        body["stop"] = None
    for key in ("suffix", "best_of"):
        body.pop(key, None)  # not supported beyond their defaults: always a 400


def _schema(server, max_examples: int, phases: list[str]):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=server.headers)
    schema.config.update(headers=server.headers, request_timeout=60)
    schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=max_examples)
    schema.config.phases.update(phases=phases)
    schema.hook("map_body")(cap_cost)
    return schema


@pytest.fixture(scope="module")
def api_schema():
    yield _schema(live_server("hostile", HOSTILE_SERVER), MAX_EXAMPLES, ["examples", "coverage", "fuzzing"])
    stop_restarted()


@pytest.fixture(scope="module")
def doc_schema(api_schema):
    return _schema(live_server("hostile", HOSTILE_SERVER), 10, ["fuzzing"])


schema = schemathesis.pytest.from_fixture("api_schema")
document = schemathesis.pytest.from_fixture("doc_schema")


def _own_problem(case, response) -> str | None:
    """The OpenAI format, checked by the same code as the hostile-input tests."""
    route = ROUTES.get(case.operation.path)
    if response.status_code >= 400:
        return error_body_problem(response.content)
    if route is None:
        return None
    if getattr(response, "stream_cut_short", False):
        return "the event stream did not end within the request timeout"
    body = case.body if isinstance(case.body, dict) else {}
    req = HostileRequest(route, json.dumps(body).encode(), "generated")
    return reply_problem(req, response.status_code, response.headers.get("content-type", [""])[0], response.content)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_error_and_openai_errors(case):
    cap_valid_body(case)
    fit_fuzzed_body(case)
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error, negative_data_rejection])
    problem = _own_problem(case, response)
    assert problem is None, f"{case.method} {case.path} {case.body!r:.300}: {problem}"


@document.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_replies_match_the_document(case):
    cap_valid_body(case)
    fit_fuzzed_body(case)
    response = case.call()
    case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                              response_schema_conformance])
