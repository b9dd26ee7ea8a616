"""Hostile request bodies for the API tests: exact JSON text (lone surrogates as ``\\ud800``
escapes, ``NaN`` and ``1e400`` literals, nesting deeper than any parser's recursion limit) for
every field of the completions and chat routes, as deterministic sweeps and as hypothesis
strategies.

Every body starts from a valid request that costs two generated tokens and stays that cheap after
its mutations (``bound_cost``), so thousands of them run in a couple of minutes on a CPU.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hypothesis import strategies as st

from apitest_server import MODEL

COMPLETIONS = "completions"
CHAT = "chat/completions"
ROUTES = (COMPLETIONS, CHAT)

BASE = {
    COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}

# A prompt 6 tokens short of the test servers' context (512), so a request without a token
# limit still ends after a few tokens.
LONG_PROMPT_IDS = [1000] * 506


class Raw(str):
    """JSON text written into the body as is (``NaN``, ``1e400``, ``[[[...]]]``)."""


def encode(value) -> str:
    """JSON text of ``value``; ``Raw`` parts go in verbatim, strings are ASCII with ``\\uXXXX``
    escapes, so a lone surrogate reaches the server as the escape, not as bytes."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def nested(depth: int, leaf: str = "1") -> Raw:
    return Raw("[" * depth + leaf + "]" * depth)


# -- hostile values ------------------------------------------------------------------------------

HUGE_INTS = [2**64, 2**64 - 1, 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 10**30, -(10**30), 2**31, -1]
# Past Python's 4,300-digit limit for int(str): json.loads itself raises.
HUGE_INT_LITERAL = Raw("9" * 5000)
FLOAT_LITERALS = [Raw(s) for s in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400",
                                   "1.7976931348623157e308")]
# High alone, low alone, and a high pair with no low half.
SURROGATES = ["a\ud800b", "\udfff", "\udbff\udbff"]
# Values of the wrong JSON type for any field (null included); each field is tried with each.
CONFUSION = ["5", "", [1], {"a": 1}, True, None, 1.5]


def short(value, limit: int = 40) -> str:
    text = str(value) if isinstance(value, Raw) else encode(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- fields ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """Where a value goes in a body: ``set(body, value)`` writes it (creating what it needs)."""

    name: str
    set: Callable[[dict, object], None] = field(repr=False)


def _top(name: str, **extra) -> Field:
    def set_(body: dict, value) -> None:
        body.update(copy.deepcopy(extra))
        body[name] = value

    return Field(name, set_)


def _at(name: str, build: Callable[[object], dict]) -> Field:
    def set_(body: dict, value) -> None:
        body.update(build(value))

    return Field(name, set_)


def _message(name: str, build: Callable[[object], dict]) -> Field:
    def set_(body: dict, value) -> None:
        body["messages"] = [build(value)]

    return Field(name, set_)


def _key(value) -> str:
    """JSON object keys are strings: a value of another type goes in as its JSON text."""
    return value if isinstance(value, str) else encode(value)


def _common_int_fields() -> list[Field]:
    return [
        _top("n"), _top("seed"), _top("top_k"), _top("min_tokens"), _top("priority"),
        _at("logit_bias.key", lambda v: {"logit_bias": {_key(v): 1}}),
        _at("logit_bias.value", lambda v: {"logit_bias": {"5": v}}),
        _at("stop_token_ids[0]", lambda v: {"stop_token_ids": [v]}),
    ]


INT_FIELDS = {
    COMPLETIONS: [
        _top("max_tokens"), _top("logprobs"), _top("best_of"), *_common_int_fields(),
        _at("prompt[0]", lambda v: {"prompt": [v]}), _at("prompt[0][0]", lambda v: {"prompt": [[1, v]]}),
    ],
    CHAT: [
        _top("max_tokens"), _top("max_completion_tokens"), _top("top_logprobs", logprobs=True),
        *_common_int_fields(),
    ],
}

_COMMON_FLOAT_FIELDS = [_top(n) for n in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                          "repetition_penalty")] + [
    _at("logit_bias.value", lambda v: {"logit_bias": {"5": v}})]
FLOAT_FIELDS = {COMPLETIONS: _COMMON_FLOAT_FIELDS, CHAT: _COMMON_FLOAT_FIELDS}

_COMMON_STR_FIELDS = [
    _top("stop"), _at("stop[1]", lambda v: {"stop": ["ok", v]}), _top("user"), _top("model"),
    _at("logit_bias.key", lambda v: {"logit_bias": {_key(v): 1}}),
]
STR_FIELDS = {
    COMPLETIONS: [_top("prompt"), _at("prompt[1]", lambda v: {"prompt": ["ok", v]}), _top("suffix"),
                  *_COMMON_STR_FIELDS],
    CHAT: [
        _message("messages[0].content", lambda v: {"role": "user", "content": v}),
        _message("messages[0].content[0].text", lambda v: {"role": "user", "content": [{"type": "text", "text": v}]}),
        _message("messages[0].name", lambda v: {"role": "user", "content": "Hi", "name": v}),
        _message("messages[0].role", lambda v: {"role": v, "content": "Hi"}),
        _message("messages[0].tool_calls.arguments", lambda v: {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": v}}]}),
        _at("chat_template_kwargs.value", lambda v: {"chat_template_kwargs": {"name": v}}),
        _at("chat_template_kwargs.key", lambda v: {"chat_template_kwargs": {_key(v): 1}}),
        *_COMMON_STR_FIELDS,
    ],
}

_COMMON_BOOL_FIELDS = [_top(n) for n in ("stream", "ignore_eos", "include_stop_str_in_output",
                                         "skip_special_tokens")] + [
    _at("stream_options.include_usage", lambda v: {"stream": True, "stream_options": {"include_usage": v}})]
BOOL_FIELDS = {
    COMPLETIONS: [_top("echo"), *_COMMON_BOOL_FIELDS],
    CHAT: [_top("logprobs"), _top("add_generation_prompt"), *_COMMON_BOOL_FIELDS],
}

# Fields whose whole value is replaced by the type-confusion values.
OTHER_FIELDS = {
    COMPLETIONS: [_top("logit_bias"), _top("stop_token_ids"), _top("stream_options")],
    CHAT: [_top("messages"), _at("messages[0]", lambda v: {"messages": [v]}), _top("logit_bias"),
           _top("stop_token_ids"), _top("stream_options"), _top("chat_template_kwargs")],
}


def all_fields(route: str) -> list[Field]:
    seen, out = set(), []
    for table in (INT_FIELDS, FLOAT_FIELDS, STR_FIELDS, BOOL_FIELDS, OTHER_FIELDS):
        for f in table[route]:
            if f.name not in seen:
                seen.add(f.name)
                out.append(f)
    return out


# -- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostileRequest:
    route: str
    body: bytes
    label: str  # what is hostile about it, for failure reports
    content_type: str | None = "application/json"
    headers: tuple[tuple[str, bytes], ...] = ()

    def __repr__(self) -> str:
        return f"<{self.route} {self.label}>"


def bound_cost(route: str, body: dict) -> None:
    """Keep an accepted request at a few generated tokens whatever its mutations did to the
    token limits: no limit means "up to the context", which costs ~500 steps."""
    if route == COMPLETIONS:
        if "max_tokens" in body and body["max_tokens"] is None:
            body["prompt"] = LONG_PROMPT_IDS
    else:
        limits = [body.get("max_tokens"), body.get("max_completion_tokens")]
        if all(v is None for v in limits):
            body["max_completion_tokens"] = 2


def build(route: str, mutations: list[tuple[Field, object]], stream: bool | None) -> HostileRequest:
    body = copy.deepcopy(BASE[route])
    for f, value in mutations:
        f.set(body, value)
    if stream is not None and not any(f.name == "stream" for f, _ in mutations):
        body["stream"] = stream
    bound_cost(route, body)
    label = "; ".join(f"{f.name}={short(v)}" for f, v in mutations)
    if stream is not None:
        label += f" stream={str(stream).lower()}"
    return HostileRequest(route, encode(body).encode("ascii"), label)


def sweep(fields: dict[str, list[Field]], values: list) -> Iterator[HostileRequest]:
    """Every field of both routes with every value, streamed and not."""
    for route in ROUTES:
        for f in fields[route]:
            for value in values:
                for stream in (False, True):
                    yield build(route, [(f, value)], stream)


# -- hypothesis strategies -------------------------------------------------------------------------

_surrogate_text = st.text(alphabet=st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12)
_float_literal = st.sampled_from(FLOAT_LITERALS)
_json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE_INTS), _float_literal,
    st.floats(allow_nan=False, allow_infinity=False), _surrogate_text,
)
_json_any = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_surrogate_text, inner, max_size=3)),
    max_leaves=6,
)
_deep = st.integers(min_value=1, max_value=3000).map(nested)

VALUES = {
    "int": st.one_of(st.sampled_from(HUGE_INTS), st.integers(), st.just(HUGE_INT_LITERAL)),
    "float": st.one_of(_float_literal, st.floats(), st.sampled_from(HUGE_INTS)),
    "str": st.one_of(st.sampled_from(SURROGATES), _surrogate_text),
    "bool": st.one_of(st.booleans(), st.sampled_from([0, 1, "true", None])),
    "other": _json_any,
}


def _kind_fields(route: str) -> list[tuple[str, Field]]:
    out = []
    for kind, table in (("int", INT_FIELDS), ("float", FLOAT_FIELDS), ("str", STR_FIELDS), ("bool", BOOL_FIELDS),
                        ("other", OTHER_FIELDS)):
        out += [(kind, f) for f in table[route]]
    return out


_KIND_FIELDS = {route: _kind_fields(route) for route in ROUTES}


@st.composite
def mutation(draw, route: str) -> tuple[Field, object]:
    kind, f = draw(st.sampled_from(_KIND_FIELDS[route]))
    # Mostly a value of the field's own kind's edges; sometimes anything at all, or deep nesting.
    value = draw(st.one_of(VALUES[kind], VALUES[kind], _json_any, _deep))
    return f, value


@st.composite
def hostile_request(draw) -> HostileRequest:
    route = draw(st.sampled_from(ROUTES))
    mutations = draw(st.lists(mutation(route), min_size=1, max_size=4))
    return build(route, mutations, draw(st.booleans()))
