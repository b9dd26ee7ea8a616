"""JSON grammars bound the whitespace between tokens (``StructuredOutputsParams.max_whitespace_cnt``,
16 by default): pretty-printed JSON of the test schemas passes, a longer run of whitespace does
not, ``None`` lifts the bound, and ``disable_any_whitespace`` still allows none. Checked on the
compiled grammars with xgrammar's matcher over SmolLM2's vocabulary."""

from __future__ import annotations

import json

import pytest

from deepbatch import envs
from deepbatch.core.sampling_params import (
    DEFAULT_MAX_WHITESPACE_CNT, SamplingParamsError, StructuredOutputsParams,
)
from deepbatch.models.loader import load_hf_config, load_tokenizer, resolve_model
from deepbatch.structured_output.grammar import GrammarCache, import_xgrammar
from sotest_schemas import SCHEMAS

VALUE = {"name": "Ada", "age": 36, "address": {"city": "Paris", "zip": "75001"}}
SCHEMA = SCHEMAS["nested_object"]


@pytest.fixture(scope="module")
def grammars():
    source, cache = resolve_model(None), envs.DEEPBATCH_CACHE_DIR  # the run's converted GGUF metadata
    return GrammarCache(load_tokenizer(source, None, cache), load_hf_config(source, cache).vocab_size, [])


def accepts(grammars, spec: StructuredOutputsParams, text: str) -> bool:
    """The grammar takes ``text`` whole and may end there."""
    matcher = import_xgrammar().GrammarMatcher(grammars.compile(spec).grammar)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("indent", [None, 2, 4])
def test_pretty_json_passes_the_default_bound(grammars, indent):
    text = json.dumps(VALUE, indent=indent)
    assert accepts(grammars, StructuredOutputsParams(json=SCHEMA), text)
    assert accepts(grammars, StructuredOutputsParams(json_object=True), text)


@pytest.mark.parametrize("run", [" " * 20, "\n" + " " * 16, "\t" * 17])
def test_a_longer_run_of_whitespace_is_rejected(grammars, run):
    text = "{" + run + json.dumps(VALUE)[1:]
    assert not accepts(grammars, StructuredOutputsParams(json=SCHEMA), text)
    assert not accepts(grammars, StructuredOutputsParams(json_object=True), text)
    # At the bound it passes; without one, any run does.
    assert accepts(grammars, StructuredOutputsParams(json=SCHEMA), "{" + run[:DEFAULT_MAX_WHITESPACE_CNT]
                   + json.dumps(VALUE)[1:])
    assert accepts(grammars, StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=None), text)
    assert accepts(grammars, StructuredOutputsParams(json_object=True, max_whitespace_cnt=64), text)


def test_compact_json_takes_no_run_at_all(grammars):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert not accepts(grammars, spec, "{  " + json.dumps(VALUE)[1:])


def test_each_bound_is_its_own_grammar(grammars):
    bounded = grammars.compile(StructuredOutputsParams(json=SCHEMA))
    assert grammars.compile(StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=16)) is bounded
    assert grammars.compile(StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=None)) is not bounded


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_bound_is_validated(value):
    with pytest.raises(SamplingParamsError, match="max_whitespace_cnt") as e:
        StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=value)
    assert e.value.param == "structured_outputs"
