"""``prompt_logprobs`` (vLLM's field) against a real server through the official client: on
/v1/completions each choice carries its prompt's list, on /v1/chat/completions the response does
(top level), in vLLM's JSON (None for the first token, then ``{"<token id>": {"logprob", "rank",
"decoded_token"}}`` with the prompt token and the top-k). The values are held to HF transformers
on the same GGUF weights and to the server's own sampled logprobs of the same token; streams and
out-of-range values are 400s naming the field."""

from __future__ import annotations

import os

import pytest
import torch

from apitest_server import MODEL, assert_error
from apitest_structured import STRUCTURED_SERVER
from apitest_structured import server, client, http, tokens  # noqa: F401  (fixtures)

SERVERS = {"structured": STRUCTURED_SERVER}
K = 2


def assert_shape(prompt_logprobs, prompt_ids: list[int], k: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token, position in zip(prompt_ids[1:], prompt_logprobs[1:]):
        assert str(token) in position and len(position) in (k, k + 1)
        for entry in position.values():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["logprob"] <= 0 and entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        # The top-k rank 1..k; the prompt token is one of them or comes after, with its own rank.
        assert sorted(e["rank"] for e in position.values())[:k] == list(range(1, k + 1))


def test_completion_prompt_logprobs_match_hf(client, tokens):
    from transformers import AutoModelForCausalLM

    from deepbatch.models.loader import default_model_path

    ids = tokens("The capital of France is Paris, and the capital of Italy is")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": K})
    got = out.choices[0].prompt_logprobs
    assert_shape(got, ids, K)
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    tol = 2e-3  # the two implementations' float32 sums differ in order
    for p in range(1, len(ids)):
        row, position = ref[p - 1], got[p]
        target = row[ids[p]].item()
        assert position[str(ids[p])]["logprob"] == pytest.approx(target, abs=tol)
        # Its rank, up to tokens within the tolerance of it.
        rank = position[str(ids[p])]["rank"]
        assert int((row > target + tol).sum()) + 1 <= rank <= int((row > target - tol).sum()) + 1
        kth = row.topk(K).values[-1].item()
        for t, e in position.items():
            assert e["logprob"] == pytest.approx(row[int(t)].item(), abs=tol)
            if e["rank"] <= K:
                assert e["logprob"] >= kth - tol


def test_a_sampled_token_scores_the_same_as_that_token_in_the_prompt(client, tokens):
    ids = tokens("One, two, three, four,")
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=K)
    sampled_lp = first.choices[0].logprobs.token_logprobs[0]
    alternatives = first.choices[0].logprobs.top_logprobs[0]
    extended = ids + tokens(first.choices[0].text)
    assert len(extended) == len(ids) + 1  # the sampled token re-tokenizes as itself
    out = client.completions.create(model=MODEL, prompt=extended, max_tokens=1, extra_body={"prompt_logprobs": K})
    last = out.choices[0].prompt_logprobs[-1]
    entry = last[str(extended[-1])]
    assert entry["rank"] == 1 and entry["decoded_token"] == first.choices[0].text
    assert entry["logprob"] == pytest.approx(sampled_lp, abs=1e-3)
    assert sorted(e["logprob"] for e in last.values()) == pytest.approx(sorted(alternatives.values()), abs=1e-3)


def test_each_choice_carries_its_prompts_list(client, tokens):
    prompts = [tokens("Hello there"), tokens("A much longer prompt about the weather today")]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, temperature=1.0, seed=1,
                                    extra_body={"prompt_logprobs": 0})
    assert len(out.choices) == 4
    for choice in out.choices:
        ids = prompts[choice.index // 2]
        assert_shape(choice.prompt_logprobs, ids, 0)
        assert all(set(p) == {str(t)} for t, p in zip(ids[1:], choice.prompt_logprobs[1:]))
    assert out.choices[0].prompt_logprobs == out.choices[1].prompt_logprobs
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


def test_chat_prompt_logprobs_are_top_level(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                         extra_body={"prompt_logprobs": 1})
    got = out.model_extra["prompt_logprobs"]
    assert len(got) == out.usage.prompt_tokens and got[0] is None
    assert all(1 <= len(p) <= 2 for p in got[1:])
    assert "prompt_logprobs" not in out.choices[0].model_extra or out.choices[0].model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
@pytest.mark.parametrize("fields, says", [
    ({"prompt_logprobs": 1, "stream": True}, "stream=True"),
    ({"prompt_logprobs": 0, "stream": True}, "stream=True"),
    ({"prompt_logprobs": -1}, "[0, 20]"),
    ({"prompt_logprobs": 21}, "[0, 20]"),
])
def test_refused_prompt_logprobs_name_the_field(http, route, body, fields, says):
    err = assert_error(http.post(route, json={"model": MODEL, **body, **fields}), 400, "prompt_logprobs")
    assert says in err["message"]
