"""Helpers for the structured-output tests: chat prompts and JSON checks against ``jsonschema``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepbatch.core.sampling_params import StructuredOutputsParams

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def chat(llm, text: str) -> dict:
    return {"prompt_token_ids": llm.engine.apply_chat_template([{"role": "user", "content": text}])}


def json_params(schema: dict, **kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, **kwargs)


def check_json_outputs(outs, schemas: list[dict], max_tokens: int) -> int:
    """Every completion either ended ("stop") with JSON that validates against its schema, or was
    cut at ``max_tokens`` ("length") before its JSON closed. Returns how many completed."""
    completed = 0
    for out, schema in zip(outs, schemas):
        assert out.error is None, out.error
        for c in out.outputs:
            if c.finish_reason == "length":
                assert len(c.token_ids) == max_tokens
                with pytest.raises(json.JSONDecodeError):
                    json.loads(c.text)
                continue
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            try:
                jsonschema.validate(json.loads(c.text), schema, format_checker=FORMAT_CHECKER)
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                raise AssertionError(f"{c.text!r} does not follow {schema}: {e}") from e
            completed += 1
    return completed
