"""What every request schema shares: strict pydantic models that refuse fields they do not
declare, integer types that fit the engine's tensors, and the check that every string is
encodable text.

Requests are strict: a string where a number belongs is a 400, not a silent coercion. A field
the schema does not declare is a 400 naming it: a client that sends a field expects it to act,
and a server that drops it silently answers a different question than the one asked. Fields the
OpenAI API defines as hints (``metadata``, ``store``, ...) are declared by the routes that take
them, and fields this server knowingly does not implement are refused with the reason
(``refuse_unsupported``). Every integer fits the type the engine keeps it in (a 70-bit ``top_k``
would wrap in a tensor), every float is finite, and every string is encodable text: JSON may
carry a lone UTF-16 surrogate (``"\\ud800"``) that no tokenizer, detokenizer or metrics label can
take.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

# OpenAI's own limit; also keeps one request from creating an unbounded number of sequences.
MAX_N = 128
MAX_LOGPROBS = 20

# Counts, ids and priorities end up in int32/int64 tensors or C loops. Ranges with a meaning
# (max_tokens >= 1, top_k == -1 or >= 1, ...) are SamplingParams' to check; this is the type.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
# The seeded sampler keys its noise by the full 64-bit seed.
Seed = Annotated[int, Field(ge=0, lt=2**64)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)


def refuse_unsupported(data: Any, unsupported: dict[str, str]) -> None:
    """A 400 naming the first field of ``data`` that is in ``unsupported`` (field -> why)."""
    if isinstance(data, dict):
        for key in data:
            if key in unsupported:
                raise PydanticCustomError(
                    "unsupported_parameter", "{param}: not supported: {reason}",
                    {"param": key, "reason": unsupported[key]})


def unencodable_string(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` (models, dicts, lists;
    dict keys included) that is not encodable as UTF-8, or None. Iterative: bodies nest as deep
    as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(v, BaseModel):
            fields = {(info.alias or name): getattr(v, name) for name, info in type(v).model_fields.items()}
            stack.append((where, {**fields, **(v.__pydantic_extra__ or {})}))
        elif isinstance(v, dict):
            for k, x in reversed(v.items()):
                key = f"{where}.{k}" if where else str(k)
                stack.append((key, x))
                stack.append((where or key, k))
        elif isinstance(v, (list, tuple)):
            # Token-id lists are the long ones: skip them in one C-level pass.
            if not set(map(type, v)) <= {int}:
                stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def check_encodable(model: BaseModel) -> None:
    where = unencodable_string(model)
    if where is not None:
        raise PydanticCustomError(
            "invalid_encoding", "{param}: the text is not valid Unicode (it holds a lone surrogate); send UTF-8",
            {"param": where})
