"""A dropped engine frees its weights and KV cache as soon as its last reference goes, without
waiting for Python's cycle collector: a program that builds one engine after another (a notebook,
a benchmark of several configurations) needs the first one's GPU memory for the next. Nothing in
the engine may hold a reference back to it."""

from __future__ import annotations

import gc
import weakref

import pytest

from deepbatch import LLM, SamplingParams


@pytest.fixture
def no_cycle_collector():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("options", [
    dict(async_scheduling=False),
    dict(async_scheduling=True),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
], ids=["sync", "async", "ngram"])
def test_dropped_llm_frees_its_model_and_kv_cache(tiny_checkpoints, no_cycle_collector, options):
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", **options)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}] * 2, SamplingParams(max_tokens=6, temperature=0.0))
    runner = llm.engine.runner
    refs = {"engine": weakref.ref(llm.engine), "model": weakref.ref(runner.model),
            "kv cache": weakref.ref(_first_tensor(runner.kv_caches))}
    del llm, runner
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert not alive, f"still referenced after the LLM was dropped: {alive}"


def _first_tensor(caches):
    while isinstance(caches, (list, tuple)):
        caches = caches[0]
    return caches
