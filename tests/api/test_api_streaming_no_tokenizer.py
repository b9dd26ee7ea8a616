"""Streaming from a model without a tokenizer (a config-only model with random weights, as the
GPU benchmarks serve): every step that produces tokens sends a chunk, so clients can time
tokens even when no text is ever produced."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from deepbatch import LLM
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.engine.async_engine import AsyncEngine

TINY = str(Path(__file__).resolve().parents[1] / "bench" / "tiny-qwen3.json")
MAX_TOKENS = 6


def test_a_chunk_per_generated_token_without_text():
    llm = LLM(TINY, dtype="float32", device="cpu", max_model_len=256)
    assert llm.engine.tokenizer is None
    with TestClient(build_app(AsyncEngine(llm.engine), ServerConfig(log_stats_interval=0))) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": [11, 12, 13, 14], "max_tokens": MAX_TOKENS, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_choices = [c for c in chunks if c["choices"]]
    # A chunk per step, none held back for lack of text; a loaded machine may merge two steps into
    # one chunk (the stream carries the newest output when its reader falls behind the engine).
    assert 2 <= len(with_choices) <= MAX_TOKENS
    assert all(c["choices"][0]["text"] == "" for c in with_choices)
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
