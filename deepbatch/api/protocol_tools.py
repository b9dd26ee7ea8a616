"""Request parts that shape what the model may write: OpenAI's ``response_format`` and
``tools`` / ``tool_choice``, and vLLM's ``structured_outputs`` (its older ``guided_*`` fields are
plain fields of the requests). ``structured.py`` and ``serving_tools.py`` turn them into the
engine's ``StructuredOutputsParams``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from deepbatch.api.protocol_base import _Request

JsonSchema = dict[str, Any]


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute; the wire name is kept by the alias.
    json_schema: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced; strict only restates it


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError('type "json_schema" needs json_schema.schema')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'json_schema goes with type "json_schema", not "{self.type}"')
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` extra field: exactly one constraint."""

    json_: JsonSchema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def constraints(self) -> dict[str, Any]:
        """The constraints set, by StructuredOutputsParams' argument names."""
        found = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None}
        return {k: v for k, v in found.items() if v is not None}


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: JsonSchema | None = None  # none: the function takes no arguments
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
