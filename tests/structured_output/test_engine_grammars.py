"""Regex, choice, EBNF and JSON-object outputs through the engine, and how a grammar meets the
rest of a request: compile errors, EOS, min_tokens, ignore_eos, logprobs, start_after_token_ids,
chunked prefill, n > 1, aborts, unconstrained neighbours and the async engine."""

from __future__ import annotations

import ast
import asyncio
import gc
import json
import math
import re
import threading
import weakref

import pytest
from sotest_helpers import chat

from deepbatch import SamplingParams
from deepbatch.engine.async_engine import AsyncEngine
from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.sampling_params import StructuredOutputsParams as Structured
from deepbatch.structured_output.grammar import GrammarCache, GrammarCompileError
from deepbatch.structured_output.matcher import StructuredOutputRequest

ARITHMETIC = r"""
root ::= expr
expr ::= term (" " op " " term){0,3}
term ::= [1-9] [0-9]{0,2} | "(" expr ")"
op ::= "+" | "-" | "*"
"""


def greedy(structured=None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 64)
    return SamplingParams(temperature=0.0, structured_outputs=structured, **kwargs)


def eos_ids(llm) -> list[int]:
    return sorted(llm.engine.eos_token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_regex_choice_grammar_and_json_object(llm, async_scheduling):
    llm.engine.async_scheduling = async_scheduling
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["Paris", "London", "Berlin", 'a "quoted" \\ choice']
    outs = llm.generate(
        [chat(llm, "What is your phone number?"), chat(llm, "What is the capital of France?"),
         chat(llm, "Write an arithmetic expression."), chat(llm, "Describe a cat."),
         chat(llm, "Say something odd.")],
        [greedy(Structured(regex=regex)), greedy(Structured(choice=choices)), greedy(Structured(grammar=ARITHMETIC)),
         greedy(Structured(json_object=True), max_tokens=256), greedy(Structured(choice=choices[3:]))],
        use_tqdm=False)
    phone, capital, expr, obj, odd = (o.outputs[0] for o in outs)
    assert all(c.finish_reason == "stop" for c in (phone, capital, expr, obj, odd)), [o.outputs for o in outs]
    assert re.fullmatch(regex, phone.text)
    assert capital.text in choices
    assert odd.text == choices[3]
    tree = ast.parse(expr.text, mode="eval")  # an independent parser of the grammar's language
    assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
               for n in ast.walk(tree)), expr.text
    assert isinstance(json.loads(obj.text), dict)


def test_eos_only_where_the_grammar_allows_it(llm):
    # A huge EOS bias makes the model stop at the first place it may: the grammar keeps EOS
    # masked until three letters stand.
    bias = {t: 100.0 for t in eos_ids(llm)}
    tok = llm.get_tokenizer()
    out = llm.generate(chat(llm, "Name an animal."), greedy(Structured(regex="[a-z]{3,8}"), logit_bias=bias),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in eos_ids(llm)
    assert re.fullmatch("[a-z]{3,8}", out.text)
    assert len(tok.decode(out.token_ids[:-2])) < 3  # EOS came as soon as the grammar allowed it
    free = llm.generate(chat(llm, "Name an animal."), greedy(logit_bias=bias), use_tqdm=False)[0].outputs[0]
    assert free.token_ids == [free.token_ids[0]] and free.text == ""


def test_min_tokens_and_ignore_eos_with_a_grammar(llm):
    bias = {t: 100.0 for t in eos_ids(llm)}
    prompt = chat(llm, "Say yes.")
    letters, only_yes, ignore = llm.generate(
        [prompt] * 3,
        [greedy(Structured(regex="[ab]{1,40}"), min_tokens=4, logit_bias=bias),
         greedy(Structured(choice=["yes"]), min_tokens=6),
         greedy(Structured(choice=["yes", "no"]), ignore_eos=True, max_tokens=20)],
        use_tqdm=False)
    letters, only_yes, ignore = (o.outputs[0] for o in (letters, only_yes, ignore))
    # min_tokens holds EOS back while the grammar allows more letters ...
    assert len(letters.token_ids) == 5 and letters.finish_reason == "stop" and re.fullmatch("[ab]{4,40}", letters.text)
    # ... but not past the grammar's end: it wins over min_tokens, and the output completes.
    assert only_yes.text == "yes" and only_yes.finish_reason == "stop" and len(only_yes.token_ids) < 6
    # With ignore_eos the request still ends when the grammar does.
    assert ignore.text in ("yes", "no") and ignore.finish_reason == "stop" and len(ignore.token_ids) < 20


def test_logprobs_are_those_of_the_masked_distribution(llm):
    choices = ["Paris", "London", "Berlin"]
    tok = llm.get_tokenizer()
    out = llm.generate(chat(llm, "Name a city."), greedy(Structured(choice=choices), logprobs=20),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in choices
    entry = out.logprobs[0]
    chosen, top = entry[out.token_ids[0]].logprob, {t: lp.logprob for t, lp in entry.items()}
    allowed = {t: lp for t, lp in top.items() if lp > -math.inf}
    assert out.token_ids[0] in allowed and chosen == top[out.token_ids[0]]
    assert all(any(c.startswith(tok.decode([t])) for c in choices) for t in allowed), allowed
    assert math.isclose(sum(math.exp(lp) for lp in allowed.values()), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_start_after_token_ids(llm, async_scheduling):
    llm.engine.async_scheduling = async_scheduling
    prompt = {"prompt_token_ids": llm.engine.tokenize("The capital of France is")}
    free = llm.generate(prompt, greedy(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    marker = tuple(free[3:5])
    assert all(tuple(free[i:i + 2]) != marker for i in range(3))  # first seen where the prefix ends
    out = llm.generate(prompt, greedy(Structured(regex="[0-9]{4}", start_after_token_ids=marker)),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:5] == free[:5]  # unconstrained through the marker
    assert re.fullmatch("[0-9]{4}", llm.get_tokenizer().decode(out.token_ids[5:-1]))
    assert out.finish_reason == "stop" and out.token_ids[-1] in eos_ids(llm)


def test_unconstrained_neighbour_gets_its_own_tokens(llm):
    llm.engine.async_scheduling = True
    prompt = chat(llm, "Tell me about Paris.")
    alone = llm.generate(prompt, greedy(max_tokens=20), use_tqdm=False)[0].outputs[0].token_ids
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}
    outs = llm.generate(
        [chat(llm, "Give me JSON."), prompt, chat(llm, "A number?"), chat(llm, "Yes or no?")],
        [greedy(Structured(json=schema, disable_any_whitespace=True)), greedy(max_tokens=20),
         greedy(Structured(regex="[0-9]{1,4}")), greedy(Structured(choice=["yes", "no"]))],
        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert 0 <= json.loads(outs[0].outputs[0].text)["a"] <= 99
    assert re.fullmatch("[0-9]{1,4}", outs[2].outputs[0].text) and outs[3].outputs[0].text in ("yes", "no")


def test_bad_grammar_fails_that_request_alone(llm):
    engine = llm.engine
    bad = [Structured(json={"type": "objectx"}), Structured(regex="(a"), Structured(grammar="root ::= missing")]
    for spec in bad:
        with pytest.raises(GrammarCompileError) as e:
            llm.generate([chat(llm, "Hi"), chat(llm, "Hi")], [greedy(Structured(regex="[0-9]")), greedy(spec)],
                         use_tqdm=False)
        assert isinstance(e.value, InvalidRequestError) and e.value.kind == spec.kind
        assert not engine.has_unfinished_requests()  # nothing of the call was queued
        with pytest.raises(InvalidRequestError):
            engine.add_request(None, chat(llm, "Hi"), greedy(spec))
    with pytest.raises(InvalidRequestError, match="start_after_token_ids"):
        engine.add_request(None, chat(llm, "Hi"), greedy(Structured(regex="a", start_after_token_ids=[10**7])))
    out = llm.generate(chat(llm, "Pick a digit."), greedy(Structured(regex="[0-9]")), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]", out.text) and out.finish_reason == "stop"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_the_vocabulary_cannot_complete_fails_that_request_alone(llm, async_scheduling):
    """After its first character no token fits the regex: that request fails as the input's fault
    (``invalid_grammar``) and its neighbour gets exactly its tokens from running alone."""
    llm.engine.async_scheduling = async_scheduling
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(chat(llm, "Count to five."), plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([chat(llm, "Say a."), chat(llm, "Count to five.")],
                        [greedy(Structured(regex="a\U000B335E")), plain], use_tqdm=False)
    assert outs[0].error_code == "invalid_grammar" and "cannot be completed" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and outs[1].outputs[0].token_ids == alone
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_matcher_fault_fails_that_request_alone(llm, monkeypatch, async_scheduling):
    llm.engine.async_scheduling = async_scheduling
    take = StructuredOutputRequest._take

    def faulty(self, output_token_ids, token):
        if self.grammar.kind == "regex" and self.num_seen == 1:
            raise RuntimeError("the matcher broke")
        return take(self, output_token_ids, token)

    monkeypatch.setattr(StructuredOutputRequest, "_take", faulty)
    prompt = chat(llm, "Say a word.")
    victim, choice, free = llm.generate(
        [prompt] * 3, [greedy(Structured(regex="[a-z]{6,10}")), greedy(Structured(choice=["yes", "no"])),
                       greedy(max_tokens=8)], use_tqdm=False)
    assert "the matcher broke" in victim.error and victim.outputs[0].finish_reason == "error"
    assert choice.error is None and choice.outputs[0].text in ("yes", "no")
    assert free.error is None and free.outputs[0].finish_reason == "length"


def test_each_sample_has_its_own_matcher_and_abort_releases_it(llm):
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=64,
                            structured_outputs=Structured(json={"type": "array", "items": {"type": "integer"}}))
    requests = engine.make_requests("abort-me", chat(llm, "Numbers please."), params)
    states = [r.structured_output for r in requests]
    engine.enqueue(requests)
    for _ in range(3):
        engine.step()
    assert states[0] is not states[1] and states[0].matcher is not states[1].matcher
    assert all(s.num_seen > 0 for s in states)
    matchers = [weakref.ref(s.matcher) for s in states]
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    assert all(r.structured_output is None for r in requests)
    assert all(m() is None for m in matchers)


def test_no_matcher_advance_on_non_final_prefill_chunks(llm):
    engine = llm.engine
    saved = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = 8
    try:
        params = greedy(Structured(regex="[0-9]{2}"))
        (request,) = engine.make_requests("chunked", chat(llm, "Give me a two-digit number, please."), params)
        state = request.structured_output
        engine.enqueue([request])
        engine.step()
        assert request.is_prefill  # a chunk short of the prompt's end (after any prefix-cache hit)
        assert state.num_seen == 0 and state.last_sample is None
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.scheduler.max_num_batched_tokens = saved
    assert re.fullmatch("[0-9]{2}", request.output_text) and request.finish_reason == "stop"


def test_async_engine_compiles_in_a_worker_thread(llm, monkeypatch):
    threads = []
    compile_grammar = GrammarCache._compile

    def spy(self, spec):
        threads.append(threading.current_thread().name)
        return compile_grammar(self, spec)

    monkeypatch.setattr(GrammarCache, "_compile", spy)
    prompt = chat(llm, "Give me a code.")
    regex = "[A-Z]{2}-[0-9]{2}-async-only"  # a new spec: compiled by this test, not found in the cache

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            with pytest.raises(GrammarCompileError, match="regular expression"):
                await engine.add_request("bad", prompt, greedy(Structured(regex="[A-")))
            outs = [o async for o in engine.generate(prompt, greedy(Structured(regex=regex)), request_id="good")]
            return outs[-1], threading.current_thread().name
        finally:
            engine.shutdown()

    final, loop_thread = asyncio.run(asyncio.wait_for(main(), 120))
    assert final.finished and re.fullmatch(regex, final.outputs[0].text)
    assert len(threads) == 2  # the bad spec and the good one, each once
    assert not any(t in (loop_thread, "deepbatch-engine") or t.startswith("deepbatch-tokenize") for t in threads)
