"""StructuredOutputsParams validation, grammar compilation and its cache, and running without
xgrammar."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from deepbatch.structured_output.grammar import GrammarCache, GrammarCompileError, StructuredOutputsUnavailableError


@pytest.mark.parametrize("kwargs, problem", [
    ({}, "exactly one"),
    ({"json": {"type": "object"}, "regex": "a+"}, "exactly one"),
    ({"choice": ["a"], "json_object": True}, "exactly one"),
    ({"json": "{not json"}, "valid JSON schema"),
    ({"json": "[1, 2]"}, "an object"),
    ({"json": {"type": "object", "x": {1, 2}}}, "valid JSON schema"),
    ({"json_object": 1}, "boolean"),
    ({"regex": ""}, "non-empty"),
    ({"grammar": 5}, "non-empty"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "non-empty list"),
    ({"choice": ["a", 1]}, "strings only"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "boolean"),
    ({"regex": "a", "start_after_token_ids": 7}, "sequence"),
    ({"regex": "a", "start_after_token_ids": [3, -1]}, ">= 0"),
    ({"regex": "a", "start_after_token_ids": [True]}, ">= 0"),
])
def test_params_are_validated_on_construction(kwargs, problem):
    with pytest.raises(SamplingParamsError, match=problem) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == "structured_outputs"


def test_params_normalize_to_hashable_sequences():
    p = StructuredOutputsParams(choice=["a", "b"], start_after_token_ids=[5, 6])
    assert p.choice == ("a", "b") and p.start_after_token_ids == (5, 6) and p.kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


@pytest.fixture(scope="module")
def vocab(smollm_llm):
    e = smollm_llm.engine
    return e.tokenizer, e.hf_config.vocab_size, e.eos_token_ids


def test_compiles_once_per_kind_and_spec(vocab):
    cache = GrammarCache(*vocab)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    first = cache.compile(StructuredOutputsParams(json=schema))
    # The same schema as text with its keys in another order is the same spec.
    reordered = '{"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}'
    assert cache.compile(StructuredOutputsParams(json=reordered)) is first
    assert cache.num_compiled == 1
    cache.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    cache.compile(StructuredOutputsParams(regex="a+"))
    cache.compile(StructuredOutputsParams(choice=["a+"]))  # same text, another kind
    assert cache.num_compiled == 4


def test_cache_is_bounded_lru(vocab):
    cache = GrammarCache(*vocab, max_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    cache.compile(a), cache.compile(b), cache.compile(a)  # a is now the most recent
    cache.compile(c)  # evicts b
    assert cache.num_compiled == 3
    cache.compile(a)
    assert cache.num_compiled == 3
    cache.compile(b)
    assert cache.num_compiled == 4


def test_prepare_uses_only_its_own_attached_grammar(vocab):
    cache, other = GrammarCache(*vocab), GrammarCache(*vocab)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="x+"))
    assert cache.prepare(SamplingParams()) is None
    mine = cache.prepare(params)
    theirs = SamplingParams(structured_outputs=params.structured_outputs, _compiled_grammar=other.prepare(params))
    assert cache.prepare(theirs) is mine  # a grammar from another vocabulary is never reused
    attached = SamplingParams(structured_outputs=params.structured_outputs, _compiled_grammar=mine)
    assert cache.prepare(attached) is mine and cache.num_compiled == 1


@pytest.mark.parametrize("spec, kind, problem", [
    ({"json": {"type": "objectx"}}, "json", 'JSON schema: Unsupported type "objectx"'),
    # A character no token of the vocabulary produces: sampling would have nothing to draw.
    ({"regex": "\U000B335E+"}, "regex", "regular expression: no token of this model's vocabulary can start"),
    ({"regex": "a(b"}, "regex", "regular expression: Regex parsing error at position 4: The parenthesis is not closed"),
    ({"grammar": "root ::= foo"}, "grammar", 'grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ({"grammar": 'root ::= "a" |'}, "grammar", "grammar: EBNF parser error"),
])
def test_compile_errors_name_the_problem(vocab, spec, kind, problem):
    cache = GrammarCache(*vocab)
    with pytest.raises(GrammarCompileError) as e:
        cache.compile(StructuredOutputsParams(**spec))
    assert isinstance(e.value, InvalidRequestError)
    assert e.value.kind == kind and e.value.param == "structured_outputs"
    assert problem in e.value.message
    assert ".cc:" not in e.value.message and "Check failed" not in e.value.message
    assert cache.num_compiled == 0


def test_choice_matches_each_string_exactly(vocab):
    import xgrammar

    choices = ['say "hi"', "back\\slash", "new\nline", "ünï", "plain"]
    grammar = GrammarCache(*vocab).compile(StructuredOutputsParams(choice=choices)).grammar
    for text in choices + ["say hi", "plain!", "back\\\\slash"]:
        m = xgrammar.GrammarMatcher(grammar)
        assert (m.accept_string(text) and m.is_completed()) == (text in choices), text


def test_missing_xgrammar_is_a_clear_request_error(vocab, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # makes ``import xgrammar`` raise ImportError
    with pytest.raises(StructuredOutputsUnavailableError, match=r"pip install 'deepbatch\[structured\]'") as e:
        GrammarCache(*vocab).compile(StructuredOutputsParams(regex="a"))
    assert isinstance(e.value, InvalidRequestError)


def test_engine_imports_and_runs_without_xgrammar(tiny_checkpoints):
    # A fresh interpreter: the engine must not import xgrammar until a request asks for a grammar,
    # and without it such a request is an InvalidRequestError while plain requests run.
    script = textwrap.dedent(f"""
        import sys
        from deepbatch import LLM, SamplingParams
        from deepbatch.core.errors import InvalidRequestError
        from deepbatch.core.sampling_params import StructuredOutputsParams
        llm = LLM({tiny_checkpoints["llama"]!r}, dtype="float32", device="cpu", max_model_len=64)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert "xgrammar" not in sys.modules, "the engine imported xgrammar eagerly"
        sys.modules["xgrammar"] = None
        try:
            llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
        except InvalidRequestError as e:
            print("ERROR", e)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        print("SERVED")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR structured_outputs: structured outputs need the xgrammar package: pip install " \
           "'deepbatch[structured]'" in done.stdout
    assert "SERVED" in done.stdout
