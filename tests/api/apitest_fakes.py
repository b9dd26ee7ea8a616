"""A fake LLMEngine for tests that need the engine's interface but no model."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from deepbatch.kv_cache.manager import KVCacheManager
from deepbatch.scheduler.preemption import Preemptor

from deepbatch.core.errors import InvalidRequestError
from deepbatch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput


class FakeEngine:
    """Just enough of LLMEngine: a request emits one token per step until its max_tokens, all
    requests run at once; ``fail_at`` makes step N raise."""

    model_name = "fake"
    tokenizer = None

    def __init__(self, fail_at: int | None = None, step_delay: float = 0.0, max_model_len: int = 1 << 30):
        self.max_model_len = max_model_len
        self.hf_config = SimpleNamespace(vocab_size=1000)
        self.fail_at = fail_at
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}
        self.callers: set[str] = set()  # threads that touched engine state
        self.stats = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0, num_steps=0)
        self.kv_cache = KVCacheManager(100, 16)
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0, running=[],
                                         preemptor=Preemptor(self.kv_cache))

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return [1] * (1 + sum(len(str(m.get("content", ""))) for m in messages))

    def make_requests(self, request_id, prompt, params, priority=0, tenant="default", arrival_time=None):
        """The real engine's checks: non-empty, token ids in the vocabulary, context length."""
        if isinstance(prompt, dict):
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            ids = [min(ord(c), 999) for c in prompt]
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < 1000 for t in ids):
            raise InvalidRequestError("prompt", "token ids must be in [0, 1000)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len or len(ids) >= self.max_model_len:
            raise InvalidRequestError("max_tokens", "too long", code="context_length_exceeded")
        return [SimpleNamespace(prompt_token_ids=ids, prompt=None, parent_id=request_id)] * params.n

    def prepare_structured_output(self, params):
        return params  # the fake follows no grammar: its tokens are fixed

    def add_request(self, request_id, prompt, params, priority=0, tenant="default", arrival_time=None):
        self.callers.add(threading.current_thread().name)
        ids = prompt["prompt_token_ids"]
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        self.requests[request_id] = {"max": max_tokens, "tokens": [], "ids": ids, "arrival": arrival_time}
        self.scheduler.num_running = len(self.requests)
        return request_id

    def abort_request(self, request_id):
        self.callers.add(threading.current_thread().name)
        r = self.requests.pop(request_id, None)
        return None if r is None else self._output(request_id, r, "abort")

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.callers.add(threading.current_thread().name)
        self.stats.num_steps += 1
        if self.stats.num_steps == self.fail_at:
            raise RuntimeError("boom")
        time.sleep(self.step_delay)
        outs = []
        for rid, r in list(self.requests.items()):
            r["tokens"].append(7)
            done = len(r["tokens"]) >= r["max"]
            if done:
                del self.requests[rid]
            outs.append(self._output(rid, r, "length" if done else None))
        self.scheduler.num_running = len(self.requests)
        return outs

    @staticmethod
    def _output(rid, r, reason):
        c = CompletionOutput(0, "x" * len(r["tokens"]), list(r["tokens"]), reason)
        return RequestOutput(rid, None, r["ids"], [c], finished=reason is not None,
                             metrics=RequestMetrics(r["arrival"]))
