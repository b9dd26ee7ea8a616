"""``--reasoning-parser`` against a real server process: the thinking goes to
``reasoning_content`` and the answer to ``content``, whole and streamed, for every choice; a
structured output constrains only the answer (the grammar starts after ``</think>``).

The model is a tiny checkpoint whose greedy output is recorded in its weights
(``apitest_reasoning_model``): ``<think>REASONING</think>CONTENT``, then end of sequence. Its
tokenizer has the think tags as special tokens, so they reach the parser only because the server
decodes these requests with special tokens kept. The server runs without tool-call flags, so it
also answers the 400 of ``tool_choice="auto"`` there."""

from __future__ import annotations

import json

import pytest

from apitest_reasoning_model import CONTENT, REASONING, build_thinking_checkpoint
from apitest_server import ServerProcess, assert_error
from apitest_streams import collect

NAME = "thinker"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_thinking_checkpoint(tmp_path_factory.mktemp("thinker"))
    proc = ServerProcess("reasoning", args=[str(path), "--served-model-name", NAME, "--reasoning-parser", "deepseek_r1",
                                            "--num-gpu-blocks-override", "64"])
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()
        proc.log.close()
        proc.out.close()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=NAME, messages=ASK, **kwargs)


def test_reasoning_is_split_from_the_answer(client):
    out = chat(client, n=2, temperature=1.0, seed=3)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.reasoning_content == REASONING
        assert choice.message.content == CONTENT


def test_reasoning_is_split_in_the_stream(client):
    choices = collect(chat(client, n=2, temperature=1.0, seed=3, stream=True))
    assert sorted(choices) == [0, 1]
    for got in choices.values():
        assert (got.reasoning, got.content, got.finish_reason) == (REASONING, CONTENT, "stop")
        assert got.deltas[0].role == "assistant"
        for delta in got.deltas:  # the tags never reach the client, and no delta mixes the two
            text = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            assert "think>" not in text and "<|im_end|>" not in text
            assert not (delta.content and getattr(delta, "reasoning_content", None))


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_constrains_the_answer_only(client, stream):
    # Unconstrained, the model would answer CONTENT; a grammar from the first token would forbid
    # "<think>" and leave no reasoning at all.
    kwargs = dict(temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    if stream:
        got = collect(chat(client, stream=True, **kwargs))[0]
        reasoning, content, reason = got.reasoning, got.content, got.finish_reason
    else:
        choice = chat(client, **kwargs).choices[0]
        reasoning, content, reason = choice.message.reasoning_content, choice.message.content, choice.finish_reason
    assert reasoning == REASONING
    assert content in ("yes", "no")
    assert reason == "stop"


def test_json_schema_applies_after_reasoning(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    choice = chat(client, temperature=0, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}).choices[0]
    assert choice.message.reasoning_content == REASONING
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content)["ok"], bool)


def test_auto_tool_choice_needs_the_server_flags(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with server.http() as http:
        for extra in ({}, {"tool_choice": "auto"}):  # "auto" is the default when tools are sent
            resp = http.post("/v1/chat/completions", json={"model": NAME, "messages": ASK, "tools": tools, **extra})
            err = assert_error(resp, 400, "tool_choice")
            assert "--enable-auto-tool-choice" in err["message"]
        # A named function needs no parser: the server reads the constrained JSON itself.
        resp = http.post("/v1/chat/completions", json={
            "model": NAME, "messages": ASK, "tools": tools, "max_tokens": MAX_TOKENS,
            "tool_choice": {"type": "function", "function": {"name": "f"}}})
        assert resp.status_code == 200, resp.text
