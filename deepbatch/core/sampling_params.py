"""Sampling parameters, validated on construction (vLLM's names and meanings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from deepbatch.core.errors import InvalidRequestError


# The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (vLLM's default cap).
MAX_LOGPROBS = 20


# JSON grammars allow at most this many whitespace characters between two tokens of the JSON: a
# model may otherwise fill the free whitespace until max_tokens. 16 takes JSON pretty-printed
# with an indent of 2 seven levels deep, with an indent of 4 three (a newline and 12 spaces).
DEFAULT_MAX_WHITESPACE_CNT = 16


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; ``param`` names it."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must follow (compiled with xgrammar by the engine). Exactly one of
    ``json``, ``json_object``, ``regex``, ``choice`` and ``grammar`` is set."""

    json: dict | str | None = None  # a JSON schema (dict, or its JSON text)
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # kept as a tuple, so the params stay hashable
    grammar: str | None = None  # EBNF as xgrammar reads it
    disable_any_whitespace: bool = False
    # JSON kinds: the most whitespace characters between two tokens of the JSON (xgrammar's
    # max_whitespace_cnt); None allows any run, as vLLM does.
    max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT
    # The grammar applies only once the output holds this token sequence (a reasoning parser's
    # end-of-thinking token, e.g. the id of "</think>"); before it sampling is unconstrained.
    start_after_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingParamsError("structured_outputs", msg)

        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                bad(f"json_object must be a boolean, got {self.json_object!r}")
            kinds.append("json_object")
        if len(kinds) != 1:
            bad("exactly one of json, json_object, regex, choice and grammar must be set, got "
                + (", ".join(kinds) if kinds else "none"))
        if self.json is not None:
            schema = self.json
            try:
                schema = json.loads(schema) if isinstance(schema, str) else json.loads(json.dumps(schema))
            except (TypeError, ValueError) as e:  # not JSON text, or a dict holding non-JSON values
                bad(f"json is not a valid JSON schema: {e}")
            if not isinstance(schema, dict):
                bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(f"{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                bad("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                bad("choice must hold strings only")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            bad(f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}")
        cnt = self.max_whitespace_cnt
        if cnt is not None and (not isinstance(cnt, int) or isinstance(cnt, bool) or cnt < 1):
            bad(f"max_whitespace_cnt must be None or an integer >= 1, got {cnt!r}")
        ids = self.start_after_token_ids
        if ids is None or isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            bad("start_after_token_ids must be a sequence of token ids")
        ids = tuple(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            bad("start_after_token_ids must be token ids >= 0")
        object.__setattr__(self, "start_after_token_ids", ids)

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0 from OpenAI-style clients is rejected) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    # For every prompt token after the first: its logprob given the tokens before it, and the
    # top ``prompt_logprobs`` alternatives (vLLM's meaning; the first token has none).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine from the model's generation config; not user-facing.
    _eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    # The engine's compiled grammar for ``structured_outputs``, attached before the request is
    # queued so that the engine thread never compiles; not user-facing.
    _compiled_grammar: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2.0 <= v <= 2.0):
                bad(name, f"must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or not (
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64
        ):
            bad("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                bad("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if not isinstance(k, int) or k < 0:
                    bad("logit_bias", f"keys must be token ids >= 0, got {k!r}")
                if not _is_number(v) or not (-100.0 <= v <= 100.0):
                    bad("logit_bias", f"values must be in [-100, 100], got {v!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        )


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
