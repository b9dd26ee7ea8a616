"""Grammars for structured outputs: compiled once per (kind, spec) against the model's vocabulary.

xgrammar is an optional dependency (``pip install 'deepbatch[structured]'``); it is imported on
the first request that asks for structured outputs, so the engine runs without it. Compiling is
the slow part (milliseconds to seconds for a large schema) and happens before a request is queued:
inline in ``LLMEngine.make_requests``, or in a worker thread for the async engine, which attaches
the result to the request's ``SamplingParams`` so that the engine thread never compiles.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.sampling_params import SamplingParams, StructuredOutputsParams

# Distinct grammars kept compiled; the least recently used is dropped beyond this.
DEFAULT_CACHE_SIZE = 256

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "grammar",
}

# xgrammar's C++ errors start with a timestamp, a source location and the failed check.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


class StructuredOutputsUnavailableError(InvalidRequestError):
    """Structured outputs were asked for and xgrammar is not installed."""


class GrammarCompileError(InvalidRequestError):
    """A schema, regex, choice list or grammar that xgrammar cannot compile. ``kind`` says which
    field of ``StructuredOutputsParams`` it was (the API maps it to its own parameter name)."""

    def __init__(self, kind: str, message: str):
        super().__init__("structured_outputs", message)
        self.kind = kind


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputsUnavailableError(
            "structured_outputs", "structured outputs need the xgrammar package: pip install 'deepbatch[structured]'"
        ) from e
    return xgrammar


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for one engine's vocabulary (``owner``), ready for matchers."""

    owner: GrammarCache
    kind: str
    grammar: object  # xgrammar.CompiledGrammar


class GrammarCache:
    """Compiles ``StructuredOutputsParams`` into xgrammar grammars over one tokenizer's vocabulary.

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's vocabulary),
    so bitmasks cover every row of the logits; ``stop_token_ids`` are the ids that end a request
    (EOS): the grammar allows them only where its output is complete. Thread-safe: the async
    engine compiles in worker threads while the engine thread looks up cached grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_size: int = DEFAULT_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_size = max_size
        self._compiler = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.num_compiled = 0  # compilations run (cache misses that succeeded)

    def prepare(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of ``params.structured_outputs`` (None without one): the one
        attached to ``params`` when this cache made it, else from the cache or compiled now."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if any(t >= self.vocab_size for t in spec.start_after_token_ids):
            raise InvalidRequestError("structured_outputs", f"start_after_token_ids must be in [0, {self.vocab_size})")
        attached = params._compiled_grammar
        if isinstance(attached, CompiledGrammar) and attached.owner is self:
            return attached
        return self.compile(spec)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._compile(spec)
        self._check_startable(spec.kind, grammar)
        compiled = CompiledGrammar(self, spec.kind, grammar)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_size:
                self._cache.popitem(last=False)
        return compiled

    def _compiler_for_vocab(self):
        with self._init_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                if self.tokenizer is None:
                    raise InvalidRequestError("structured_outputs", "this model has no tokenizer, which structured "
                                              "outputs need")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Our own bounded LRU caches compiled grammars; xgrammar's cache would be a second,
                # unbounded one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _check_startable(self, kind: str, grammar) -> None:
        """Refuse a grammar that no token of this vocabulary can start (a regex over characters
        the tokenizer cannot produce, say): sampling would have nothing to draw from. A grammar
        that accepts the empty output allows the stop tokens, so it passes."""
        xgr = import_xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise GrammarCompileError(kind, f"invalid {_KIND_NAMES[kind]}: no token of this model's vocabulary can "
                                            f"start an output it accepts")

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler_for_vocab()
        # Whitespace between JSON tokens: none, or runs of at most max_whitespace_cnt characters.
        whitespace = ({"any_whitespace": False} if spec.disable_any_whitespace
                      else {"any_whitespace": True, "max_whitespace_cnt": spec.max_whitespace_cnt})
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, **whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                # JSON string literals are EBNF string literals (same escapes), so any text is exact.
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # whatever xgrammar raises is this request's input error
            raise GrammarCompileError(kind, f"invalid {_KIND_NAMES[kind]}: {_clean(e)}") from e


def _cache_key(spec: StructuredOutputsParams) -> tuple:
    kind = spec.kind
    if kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return kind, json.dumps(schema, sort_keys=True), spec.disable_any_whitespace, spec.max_whitespace_cnt
    if kind == "json_object":
        return kind, spec.disable_any_whitespace, spec.max_whitespace_cnt
    return kind, getattr(spec, kind)


def _clean(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    # The JSON parser's message repeats the whole input after its own text.
    text = text.split(". The JSON string is:", 1)[0]
    return " ".join(text.split())[:500]
