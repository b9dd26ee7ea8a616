"""What a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of the server.

- ``none``: the tools still reach the chat template (as vLLM does), the output is plain content;
- ``auto`` (the default when tools are sent): the model decides, and the server's
  ``--tool-call-parser`` finds the calls in its output; without ``--enable-auto-tool-choice``
  and a parser it is a 400, as with vLLM;
- ``required`` and a named function: the output is constrained by a JSON-schema grammar built
  from the tools' parameter schemas, and the server reads the calls out of that JSON itself, so
  no tool-call parser is needed. A named function's output is its arguments object; ``required``
  writes ``[{"name": ..., "parameters": {...}}, ...]``, one item per call (one at most with
  ``parallel_tool_calls`` false), each item one of the tools (``anyOf``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from deepbatch.api.errors import bad_request
from deepbatch.api.protocol import ChatCompletionRequest
from deepbatch.api.structured import Constraint, request_constraints, single

# OpenAI: a function without a parameters schema has an empty parameter list.
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    template_tools: list[dict] | None = None  # for apply_chat_template(tools=...)
    function: str | None = None  # the named function
    parallel: bool = True
    constraint: Constraint | None = None  # required / named: the grammar

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("auto", "required", "named")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_tools(req: ChatCompletionRequest, auto_tools: bool) -> ToolPlan:
    """``auto_tools``: the server runs with --enable-auto-tool-choice and a tool-call parser."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice: there are no tools to choose from; send tools", "tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} is defined twice", "tools")
    template_tools = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are sent
    if choice == "none":
        return ToolPlan("none", template_tools, parallel=parallel)
    if choice == "auto":
        if not auto_tools:
            implied = "" if req.tool_choice is not None else " (the default when tools are sent)"
            raise bad_request(f'tool_choice: "auto"{implied} needs the server to run with --enable-auto-tool-choice '
                              'and --tool-call-parser; send tool_choice "required", a named function or "none"',
                              "tool_choice")
        return ToolPlan("auto", template_tools, parallel=parallel)
    if choice == "required":
        schema = _calls_schema(tools, parallel)
        return ToolPlan("required", template_tools, parallel=parallel,
                        constraint=Constraint("tools", {"json": schema, "disable_any_whitespace": True}))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice: no tool is named {name!r}; the tools are {', '.join(names)}"[:400],
                          "tool_choice")
    schema = tools[names.index(name)].function.parameters or _NO_ARGUMENTS
    # Compact JSON: the server wrote this grammar, and whitespace between tokens is only cost.
    return ToolPlan("named", template_tools, function=name, parallel=parallel,
                    constraint=Constraint("tools", {"json": schema, "disable_any_whitespace": True}))


def output_constraint(req: ChatCompletionRequest, plan: ToolPlan) -> Constraint | None:
    """The request's one output constraint: its structured-output fields' or its tool plan's."""
    constraint = single(request_constraints(req))
    if plan.constraint is None:
        return constraint
    if constraint is not None:
        what = '"required"' if plan.mode == "required" else "a named function"
        raise bad_request(f"tool_choice: {what} constrains the output to tool calls; it cannot be combined with "
                          f"{constraint.source}", "tool_choice", code="conflicting_parameters")
    return plan.constraint


def _calls_schema(tools, parallel: bool) -> dict:
    """``[{"name": <one tool>, "parameters": <its schema>}, ...]``. Each tool's schema moves
    under the root's ``$defs`` (with its own ``$defs``), its ``$ref``s rewritten to match, so
    references inside a tool's schema still resolve once it is nested."""
    defs: dict[str, Any] = {}
    items = []
    for i, t in enumerate(tools):
        params = t.function.parameters or _NO_ARGUMENTS
        if _has_ref(params):
            params = _hoist(params, f"t{i}", defs)
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items} if len(items) > 1 else items[0]}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _has_ref(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("$ref"), str):
                return True
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _hoist(params: dict, prefix: str, defs: dict) -> dict:
    """``params`` as ``{"$ref": "#/$defs/<prefix>"}``, with it and its own definitions in ``defs``."""
    own = {}
    for key in ("$defs", "definitions"):
        for name, sub in (params.get(key) or {}).items():
            own[f"#/{key}/{name}"] = f"{prefix}_{name}"
    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}

    def rewrite(v: Any) -> Any:
        if isinstance(v, dict):
            out = {k: rewrite(x) for k, x in v.items()}
            ref = v.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    out["$ref"] = f"#/$defs/{prefix}"
                elif ref in own:
                    out["$ref"] = f"#/$defs/{own[ref]}"
                elif ref.startswith("#/"):
                    out["$ref"] = f"#/$defs/{prefix}/{ref[2:]}"
            return out
        if isinstance(v, list):
            return [rewrite(x) for x in v]
        return v

    defs[prefix] = rewrite(body)
    for key in ("$defs", "definitions"):
        for name, sub in (params.get(key) or {}).items():
            defs[f"{prefix}_{name}"] = rewrite(sub)
    return {"$ref": f"#/$defs/{prefix}"}
