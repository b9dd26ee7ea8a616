"""``echo`` with ``logprobs`` on /v1/completions against a real server through the official client,
as loglikelihood clients (lm-evaluation-harness's ``local-completions``) use it: the choice's
logprobs cover the prompt tokens (the first with null values), then the generated ones, and
``text`` is the prompt and the completion. The prompt part is held to the server's own
``prompt_logprobs`` for the same prompt and to HF transformers on the same GGUF weights; the
generated part to the same request without echo. ``max_tokens: 0`` with echo returns the prompt
alone (no generated token counted); streams send the prompt part in their first chunk."""

from __future__ import annotations

import json
import os

import pytest
import torch

from apitest_server import MODEL, assert_error
from apitest_structured import STRUCTURED_SERVER
from apitest_structured import server, client, http, tokens  # noqa: F401  (fixtures)

SERVERS = {"structured": STRUCTURED_SERVER}
K = 2
PROMPT = "The capital of France is Paris, and the capital of Italy is"


def scored(client, prompt, k: int) -> list:
    """The server's ``prompt_logprobs`` for ``prompt``: the independent source of the prompt part."""
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": k})
    return out.choices[0].prompt_logprobs


def assert_prompt_part(lp, ids: list[int], expected: list, first_text: str) -> None:
    """The first ``len(ids)`` entries of ``lp`` are the prompt's, as ``expected`` (vLLM's
    prompt_logprobs JSON) gives them in the legacy completions shape."""
    assert lp.tokens[0] == first_text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        own = expected[p][str(ids[p])]
        assert lp.tokens[p] == own["decoded_token"]
        assert lp.token_logprobs[p] == pytest.approx(own["logprob"], abs=1e-4)
        want = {e["decoded_token"]: e["logprob"] for e in expected[p].values()}
        assert lp.top_logprobs[p] == pytest.approx(want, abs=1e-4)


def assert_offsets_index_text(lp, text: str) -> None:
    assert lp.text_offset == sorted(lp.text_offset)
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert text[offset:offset + len(token)] == token


def test_echo_logprobs_cover_the_prompt_then_the_completion(client, http, tokens):
    ids = tokens(PROMPT)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=K, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=K)
    choice, want = echo.choices[0], plain.choices[0]
    assert choice.text == PROMPT + want.text
    lp = choice.logprobs
    n_out = len(want.logprobs.tokens)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + n_out
    first = http.post("/detokenize", json={"tokens": ids[:1]}).json()["prompt"]
    assert_prompt_part(lp, ids, scored(client, PROMPT, K), first)
    assert all(len(top) in (K, K + 1) for top in lp.top_logprobs[1:len(ids)])
    # The generated part is the non-echo reply's, its offsets shifted past the echoed prompt.
    assert lp.tokens[len(ids):] == want.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
    for got, ref in zip(lp.top_logprobs[len(ids):], want.logprobs.top_logprobs):
        assert got == pytest.approx(ref, abs=1e-4)
    assert lp.text_offset[len(ids):] == [o + len(PROMPT) for o in want.logprobs.text_offset]
    assert lp.text_offset[0] == 0
    assert_offsets_index_text(lp, choice.text)
    assert echo.usage.completion_tokens == n_out and echo.usage.prompt_tokens == len(ids)
    # Not asked for: the choice carries no prompt_logprobs list of its own.
    assert choice.model_extra.get("prompt_logprobs") is None


def test_prompt_part_matches_hf(client, tokens):
    from transformers import AutoModelForCausalLM

    from deepbatch.models.loader import default_model_path

    ids = tokens("One, two, three, four, five")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    got = out.choices[0].logprobs.token_logprobs[:len(ids)]
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert got[0] is None
    assert got[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=2e-3)


def test_n_and_several_prompts(client, tokens):
    prompts = ["Hello there", "A much longer prompt about the weather today"]
    kwargs = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1}
    echo = client.completions.create(echo=True, **kwargs)
    plain = client.completions.create(**kwargs)
    assert [c.index for c in echo.choices] == [0, 1, 2, 3]
    expected = [scored(client, p, 1) for p in prompts]
    for c, ref in zip(echo.choices, plain.choices):
        i = c.index // 2
        ids = tokens(prompts[i])
        assert c.text == prompts[i] + ref.text
        assert_prompt_part(c.logprobs, ids, expected[i], c.logprobs.tokens[0])
        assert c.logprobs.tokens[len(ids):] == ref.logprobs.tokens
        assert c.logprobs.token_logprobs[len(ids):] == pytest.approx(ref.logprobs.token_logprobs, abs=1e-4)
        assert_offsets_index_text(c.logprobs, c.text)
    assert echo.choices[0].logprobs.token_logprobs[:2] == echo.choices[1].logprobs.token_logprobs[:2]
    assert echo.usage.completion_tokens == plain.usage.completion_tokens


def test_logprobs_and_prompt_logprobs_keep_their_own_k(client, tokens):
    ids = tokens(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                    extra_body={"prompt_logprobs": 3})
    c = out.choices[0]
    assert c.prompt_logprobs == scored(client, PROMPT, 3)
    assert all(len(top) in (1, 2) for top in c.logprobs.top_logprobs[1:len(ids)])
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=3, echo=True,
                                    extra_body={"prompt_logprobs": 0})
    c = out.choices[0]
    assert all(set(p) == {str(t)} for t, p in zip(ids[1:], c.prompt_logprobs[1:]))
    assert all(len(top) in (3, 4) for top in c.logprobs.top_logprobs[1:len(ids)])


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(client, http, tokens):
    ids = tokens(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=K, echo=True)
    c = out.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ids)
    assert_prompt_part(c.logprobs, ids, scored(client, PROMPT, K), c.logprobs.tokens[0])
    assert_offsets_index_text(c.logprobs, c.text)
    assert out.usage.completion_tokens == 0 and out.usage.total_tokens == len(ids)
    bare = client.completions.create(model=MODEL, prompt=[PROMPT, "Hi"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in bare.choices] == [PROMPT, PROMPT, "Hi", "Hi"]
    assert all(c.logprobs is None for c in bare.choices) and bare.usage.completion_tokens == 0
    # Without echo there is nothing to return: still refused.
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 0}), 400,
                 "max_tokens")


def stream_choices(http, body: dict) -> tuple[list[dict], dict | None]:
    choices, usage = [], None
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choices.extend(chunk["choices"])
            usage = chunk.get("usage") or usage
    return choices, usage


@pytest.mark.parametrize("max_tokens", [4, 0])
def test_stream_sends_the_prompt_part_first(client, http, tokens, max_tokens):
    ids = tokens(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": K, "echo": True}
    whole = client.completions.create(model=MODEL, **body).choices[0]
    choices, usage = stream_choices(http, {**body, "stream_options": {"include_usage": True}})
    assert choices[0]["text"].startswith(PROMPT)
    assert choices[0]["logprobs"]["tokens"][:len(ids)] == whole.logprobs.tokens[:len(ids)]
    assert "".join(c["text"] for c in choices) == whole.text
    for field in ("tokens", "text_offset"):
        assert [x for c in choices for x in c["logprobs"][field]] == getattr(whole.logprobs, field)
    got = [x for c in choices for x in c["logprobs"]["token_logprobs"]]
    assert got[0] is None and got[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)
    assert choices[-1]["finish_reason"] == whole.finish_reason
    assert usage["completion_tokens"] == len(whole.logprobs.tokens) - len(ids)


def test_stream_still_refuses_an_explicit_prompt_logprobs(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True, "echo": True, "logprobs": 1,
            "prompt_logprobs": 1}
    assert_error(http.post("/v1/completions", json=body), 400, "prompt_logprobs")
