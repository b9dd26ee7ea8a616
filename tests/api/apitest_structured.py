"""The server, its module-scoped fixtures and the JSON schemas the structured-output, tool and
logprob tests share (a module imports the fixtures it uses by name).

The schemas cover nested objects, arrays, enums, anyOf, oneOf, required and optional fields, string
formats and patterns, numbers with bounds, const, type unions and $ref; each keeps its strings,
numbers and arrays bounded, so a small model finishes the JSON within a few dozen tokens.
Whitespace between tokens is free under a JSON grammar, and a sampled run of it can outlast any
token budget: the schemas sent with ``disable_any_whitespace`` (``COMPACT``) are the ones where
SmolLM2 falls into such a run.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from apitest_server import REPO, get_server

TEMPLATE = REPO / "tests" / "api" / "data" / "tool_chat_template.jinja"
# Tool flags on (auto tool choice parses Hermes-style calls) and a chat template that renders
# tools and names itself, so tests can tell it replaced SmolLM2's; rendered tools take a few
# hundred tokens, hence the longer context.
STRUCTURED_SERVER = dict(args=["--max-model-len", "1024", "--num-gpu-blocks-override", "1024",
                               "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser",
                               "hermes"])
TEMPLATE_MARK = "DeepbatchTestBot"

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "nick": {"type": "string", "maxLength": 10}},
                 "required": ["id", "nick"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                       "minItems": 1, "maxItems": 3}},
             "required": ["tags"]},
    "enum_root": {"type": "string", "enum": ["north", "south", "east", "west"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                   {"type": "string", "maxLength": 5}]}},
               "required": ["value"]},
    "number_bounds": {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                                       "temp": {"type": "number", "minimum": -50, "maximum": 50}},
                      "required": ["ratio", "temp"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"type": "string", "maxLength": 4}},
                 "required": ["a"]},
    "date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "ipv6": {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv6"}}, "required": ["ip"]},
    "uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    "one_of": {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["square"], "additionalProperties": False}]},
    "ipv4": {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"},
                                               "x": {"type": "integer", "minimum": -9, "maximum": 9},
                                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
              "required": ["kind", "x", "y"]},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 5},
                                         "v": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k", "v"]}},
    "matrix": {"type": "array", "minItems": 1, "maxItems": 2,
               "items": {"type": "array", "minItems": 1, "maxItems": 2,
                         "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "bool_null": {"type": "object", "properties": {"flag": {"type": "boolean"}, "nothing": {"type": "null"}},
                  "required": ["flag", "nothing"]},
    "type_union": {"type": "object", "properties": {"v": {"type": ["integer", "boolean"], "minimum": 0, "maximum": 9}},
                   "required": ["v"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
             "required": ["from", "to"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "exclusive": {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
                                                   "words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                             "maxItems": 2}},
                  "required": ["n", "words"], "additionalProperties": False},
}

# Sent as vLLM's structured_outputs with disable_any_whitespace (see the module docstring).
COMPACT = {"matrix", "ipv6"}
# Sent as vLLM's older guided_json, as JSON text.
GUIDED_JSON_TEXT = {"tags"}


def constraint_fields(name: str) -> dict:
    """The request fields that ask for schema ``name``, in the spelling the tests give it."""
    schema = SCHEMAS[name]
    if name in COMPACT:
        return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    if name in GUIDED_JSON_TEXT:
        return {"guided_json": json.dumps(schema)}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}


def schema_problem(name: str, text: str) -> str | None:
    """Why ``text`` is not an instance of schema ``name`` (formats checked too), or None."""
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:300]} in {text[:300]!r}"
    return None


# -- fixtures over the shared "structured" server --------------------------------------------


@pytest.fixture(scope="module")
def server():
    return get_server("structured")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def tokens(http):
    """The server's own tokenizer (``/tokenize``)."""
    def encode(text: str) -> list[int]:
        return http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    return encode
