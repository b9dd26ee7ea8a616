"""A request's output constraint as the engine's ``StructuredOutputsParams``.

Clients spell a constraint several ways: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and (built by ``serving_tools``) ``tool_choice`` ``required`` or a named
function. A request carries at most one; two are a 400, as which should win is not the server's
guess. Each constraint remembers the field it came from, so an error about it (a schema xgrammar
cannot compile) names that field.

``StructuredOutputsParams`` is imported when a request first needs it: the server starts and
serves unconstrained requests without the structured-outputs extra installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deepbatch.api.errors import APIError, bad_request

# The engine's name for the parameter; errors under it are renamed to the client's field.
ENGINE_PARAM = "structured_outputs"


@dataclass(frozen=True)
class Constraint:
    source: str  # the request field it came from
    kwargs: dict[str, Any] = field(default_factory=dict)  # StructuredOutputsParams arguments


def _schema(value: Any, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text, as an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise bad_request(f"{param}: the schema is not valid JSON: {e}", param, code="invalid_schema") from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: a JSON schema must be an object, got {type(value).__name__}", param,
                          code="invalid_schema")
    return value


def request_constraints(req) -> list[Constraint]:
    """The constraints a completions or chat request sets through the structured-output fields."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = _schema(fmt.json_schema.json_schema, "response_format")
        found.append(Constraint("response_format", {"json": schema}))
    so = req.structured_outputs
    if so is not None:
        kinds = so.constraints()
        if len(kinds) != 1:
            raise bad_request("structured_outputs: set exactly one of json, regex, choice, grammar and json_object, "
                              f"got {len(kinds)}" + (f" ({', '.join(kinds)})" if kinds else ""),
                              "structured_outputs", code="conflicting_parameters")
        kwargs = dict(kinds)
        if "json" in kwargs:
            kwargs["json"] = _schema(kwargs["json"], "structured_outputs")
        if "choice" in kwargs:
            kwargs["choice"] = list(kwargs["choice"])
        if so.disable_any_whitespace:
            kwargs["disable_any_whitespace"] = True
        found.append(Constraint("structured_outputs", kwargs))
    if req.guided_json is not None:
        found.append(Constraint("guided_json", {"json": _schema(req.guided_json, "guided_json")}))
    for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(Constraint(name, {kind: list(value) if kind == "choice" else value}))
    return found


def single(constraints: list[Constraint]) -> Constraint | None:
    """The one constraint of a request; a second is a 400 naming it."""
    if len(constraints) > 1:
        first, second = constraints[0].source, constraints[1].source
        raise bad_request(f"{second}: a request takes one output constraint and {first} already sets one",
                          second, code="conflicting_parameters")
    return constraints[0] if constraints else None


def structured_outputs(constraint: Constraint, start_after_token_ids: tuple[int, ...] = ()):
    """The engine's ``StructuredOutputsParams`` for ``constraint``; the grammar starts after
    ``start_after_token_ids`` (a reasoning parser's end of thinking) when given."""
    try:
        from deepbatch.core.sampling_params import StructuredOutputsParams
    except ImportError:
        raise APIError(400, f"{constraint.source}: structured outputs are not available in this build of the engine",
                       param=constraint.source, code="unsupported_parameter") from None
    kwargs = dict(constraint.kwargs)
    if start_after_token_ids:
        kwargs["start_after_token_ids"] = tuple(start_after_token_ids)
    return StructuredOutputsParams(**kwargs)


def param_alias(constraint: Constraint | None) -> dict[str, str]:
    """Engine errors about the constraint, renamed to the field the client sent it in."""
    return {ENGINE_PARAM: constraint.source} if constraint is not None else {}
