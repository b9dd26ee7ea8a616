"""JSON schemas for the structured-output tests: each keyword family xgrammar turns into a grammar,
with every string, array and number bounded so that sampled outputs end within a test's budget.
String formats are those whose grammar is no looser than ``jsonschema``'s format checker (xgrammar's
``date`` takes February 30th; ``email`` has no length bound)."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "address"],
    },
    "int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        },
        "required": ["color", "size"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                                {"type": "string", "maxLength": 6}, {"type": "null"}]},
        },
        "required": ["value"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "note": {"type": "string", "maxLength": 10},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
    },
    "string_formats": {
        "type": "object",
        "properties": {
            "uuid": {"type": "string", "format": "uuid"},
            "ip": {"type": "string", "format": "ipv4"},
        },
        "required": ["uuid", "ip"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "temp": {"type": "number", "minimum": -40.5, "maximum": 60},
        },
        "required": ["ratio", "count", "temp"],
    },
    "object_array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 5}, "v": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "const_nullable": {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "label": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["kind", "label"],
    },
    "refs": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                               "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x", "y"],
            },
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
    "one_of_and_pattern": {
        "type": "object",
        "properties": {
            "status": {"oneOf": [{"const": "active"}, {"const": "inactive"}]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        },
        "required": ["status", "code"],
    },
    "tuple_items": {
        "type": "array",
        "prefixItems": [{"type": "string", "enum": ["x", "y"]}, {"type": "boolean"}],
        "items": False,
        "minItems": 2,
    },
}
