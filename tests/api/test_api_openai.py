"""The OpenAI API through the official client against a real server process: completions and
chat, streaming and not, usage, stop strings, seeds, n > 1, logprobs, prompt forms, and greedy
text equal to ``LLM.generate``."""

from __future__ import annotations

import json
import sys

import openai
import pytest

from apitest_server import API_KEY, MAIN_SERVER, MODEL, REPO, get_background, get_server, parse_metrics

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
MAX_TOKENS = 16

# LLM.generate on the same prompts, in its own process so that its model load overlaps the server's.
_REFERENCE = f"""
import json
from deepbatch import LLM, SamplingParams
llm = LLM(max_model_len=512, num_gpu_blocks_override=256)
p = SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS})
texts = [llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].text for prompt in {PROMPTS!r}]
chat = llm.chat({CHAT!r}, p, use_tqdm=False)[0].outputs[0].text
print(json.dumps({{"completions": texts, "chat": chat}}))
"""

SERVERS = {"main": MAIN_SERVER}
BACKGROUND = {"reference": [sys.executable, "-c", _REFERENCE]}
METRICS = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
           "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
           "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
           "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"]


@pytest.fixture(scope="module")
def server():
    return get_server("main")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def reference():
    return json.loads(get_background("reference").output().strip().splitlines()[-1])


def same_counts(a, b) -> bool:
    """Equal token counts; the cached ones may differ (the second request finds the first's
    prompt in the prefix cache)."""
    counts = [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in (a, b)]
    return counts[0] == counts[1] and a.prompt_tokens_details is not None and b.prompt_tokens_details is not None


def greedy(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def test_models_health_version(server):
    with server.http() as http:
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 512
        assert http.get("/version").json()["version"]
    with server.http(headers={}) as anonymous:
        assert anonymous.get("/health").status_code == 200  # /health needs no key


def test_completion_usage_and_finish(client):
    out = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 6, 11)


def test_greedy_equals_llm_generate(client, reference):
    got = [greedy(client, p).choices[0].text for p in PROMPTS]
    assert got == reference["completions"]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == reference["chat"]
    assert chat.choices[0].message.role == "assistant"


def test_metrics_and_dashboard(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with server.http() as http:
        resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    names = {key.split("{")[0] for key in parse_metrics(resp.text)}
    assert set(METRICS) <= names
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in resp.text
    assert 'finished_reason="length"' in resp.text
    dashboard = json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for name in METRICS:
        assert name.removesuffix("_bucket") in exprs, name


def test_completion_stream_matches_non_stream(client):
    full = greedy(client, PROMPTS[0])
    chunks = list(greedy(client, PROMPTS[0], stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and same_counts(chunks[-1].usage, full.usage)


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert same_counts(chunks[-1].usage, full.usage)
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    text = greedy(client, PROMPTS[0], extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    kwargs = dict(stop=[stop, "@@never@@"], extra_body={"ignore_eos": True})
    if stream:
        chunks = [c for c in greedy(client, PROMPTS[0], stream=True, **kwargs) if c.choices]
        got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = greedy(client, PROMPTS[0], **kwargs).choices[0]
        got, reason = choice.text, choice.finish_reason
        assert choice.model_extra["stop_reason"] == stop
    assert (got, reason) == (expected, "stop")


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_n_choices(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, n=3, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(texts.values())


def test_multiple_prompts_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=3, temperature=0)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.usage.prompt_tokens == 5 and by_ids.usage.completion_tokens == 4


def test_multiple_prompts_streaming_and_echo(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=3, temperature=0)
    full = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == full
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + full[0]


def test_completion_logprobs(client):
    out = greedy(client, PROMPTS[0], logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
        assert top[token] == pytest.approx(logprob)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_vllm_extra_fields(client):
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0.8, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"28": -100}, user="tenant-a", seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 8, "ignore_eos": False},
    )
    assert out.usage.completion_tokens == 8  # min_tokens holds EOS off; max_tokens ends it
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens <= 3


def test_auth_required(server):
    with server.http(headers={}) as anonymous:
        for path in ("/v1/models", "/metrics", "/version"):
            resp = anonymous.get(path)
            assert resp.status_code == 401, path
            assert resp.json()["error"]["code"] == "invalid_api_key"
        wrong = anonymous.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
