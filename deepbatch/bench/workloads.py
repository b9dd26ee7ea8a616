"""The offline workloads of the benchmark suite (see docs/benchmarks.md), generated exactly and
seeded, so every engine and peer sees the same token ids and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float = 0.0

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        """The longest request's prompt plus output tokens."""
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

    def head(self, n: int) -> "Workload":
        return Workload(self.name, self.prompts[:n], self.output_lens[:n], self.temperature)


def nano(num_requests: int = 256, name: str = "nano") -> Workload:
    """nano-vllm's bench.py: lengths and ids from Python's ``random`` seeded 0, prompts first
    (each: its length, then its ids), then all output lengths."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_requests)]
    outs = [random.randint(100, 1024) for _ in range(num_requests)]
    return Workload(name, prompts, outs, temperature=0.6)


def fixed(name: str, num_requests: int, prompt_len: int, output_len: int, vocab: int, seed: int = 0) -> Workload:
    """vLLM's random dataset with range ratio 0: fixed lengths, uniform random ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(vocab, 32000), size=(num_requests, prompt_len))
    return Workload(name, ids.tolist(), [output_len] * num_requests)


def shared_prefix(num_requests: int, prefix_len: int, unique_len: int, output_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, min(vocab, 32000), size=prefix_len).tolist()
    uniq = rng.integers(0, min(vocab, 32000), size=(num_requests, unique_len)).tolist()
    return Workload("prefix", [prefix + u for u in uniq], [output_len] * num_requests)


def cpu_smol(vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 256))] for _ in range(64)]
    return Workload("cpu-smol", prompts, [64] * 64)


def kv_multiple(name: str, factor: int, kv_capacity_tokens: int, vocab: int, prompt_len: int = 256,
                output_len: int = 256) -> Workload:
    """Requests whose final contexts (prompt + output) add up to ``factor`` times the KV capacity,
    all queued at once: greedy admission fills the pool with prompts, then decodes outgrow it."""
    n = max(1, factor * kv_capacity_tokens // (prompt_len + output_len))
    return fixed(name, n, prompt_len, output_len, vocab)


def copy_heavy(tokenizer, num_requests: int = 256, output_len: int = 128, seed: int = 0) -> Workload:
    """Requests whose answers copy their prompts, as code edits, answers quoted from a document
    and summaries do (where speculative decoding by prompt lookup pays), from real text every
    Python install has: the standard library's own functions (code) and the language reference's
    topics (``pydoc_data``, English). Greedy, ``output_len`` tokens each."""
    import inspect
    import json
    import pydoc_data.topics
    import textwrap

    topics = pydoc_data.topics.topics
    documents = [topics[k][:2400] for k in sorted(topics) if len(topics[k]) > 1200]
    functions = [inspect.getsource(f) for module in (textwrap, json.decoder, inspect)
                 for _, f in sorted(vars(module).items()) if inspect.isfunction(f) and f.__module__ == module.__name__
                 and 400 < len(inspect.getsource(f)) < 2400]
    tasks = [
        lambda: "Here is a Python function:\n\n" + rng.choice(functions) + "\nRewrite it with type hints on "
        "every argument and a docstring. Reply with the whole function.\n\n",
        lambda: "Document:\n" + rng.choice(documents) + "\n\nQuote the document's first two sentences word for "
        "word, then explain them.\n\nQuote:",
        lambda: "Summarize the following text in a few sentences, reusing its own wording.\n\n"
        + rng.choice(documents) + "\n\nSummary:",
    ]
    rng = random.Random(seed)
    prompts = [tokenizer.encode(tasks[i % len(tasks)]()) for i in range(num_requests)]
    return Workload("copy-heavy", prompts, [output_len] * num_requests)


WORKLOADS = ["nano", "nano-x4", "seed-table", "random-1k", "random-short", "mla-moe", "prefix", "cpu-smol", "kv-2x",
             "long-swa", "long-prompt", "copy-heavy"]
# Workloads of real text, built with the model's tokenizer.
TEXT_WORKLOADS = {"copy-heavy"}
# Workloads sized from the engine's KV capacity (known only once the engine is built).
KV_SIZED = {"kv-2x": 2}


def make_workload(name: str, vocab: int, num_requests: int | None = None,
                  kv_capacity_tokens: int | None = None, tokenizer=None) -> Workload:
    if name in TEXT_WORKLOADS and tokenizer is None:
        raise ValueError(f"workload {name!r} is real text: it needs the model's tokenizer (a random-weight config "
                         "takes one with --tokenizer DIR)")
    if name == "copy-heavy":
        w = copy_heavy(tokenizer, num_requests or 256)
    elif name in KV_SIZED:
        if kv_capacity_tokens is None:
            raise ValueError(f"workload {name!r} is sized from the KV capacity; pass kv_capacity_tokens")
        w = kv_multiple(name, KV_SIZED[name], kv_capacity_tokens, vocab)
    elif name == "nano":
        w = nano(256)
    elif name == "nano-x4":
        w = nano(1024, "nano-x4")
    elif name == "seed-table":
        w = fixed(name, 1000, 1024, 512, vocab)
    elif name == "random-1k":
        w = fixed(name, 1000, 1024, 1024, vocab)
    elif name == "random-short":
        w = fixed(name, 1000, 1024, 128, vocab)
    elif name == "mla-moe":
        w = fixed(name, 1000, 1024, 512, vocab)
    elif name == "long-swa":  # sliding-window configs (mistral-7b v0.1, window 4,096) with and without it
        w = fixed(name, 1000, 8192, 512, vocab)
    elif name == "long-prompt":  # long-context prefill: MLA's expanded path against a dense GQA model
        w = fixed(name, 1000, 8192, 256, vocab)
    elif name == "prefix":
        w = shared_prefix(1000, 2048, 128, 128, vocab)
    elif name == "cpu-smol":
        w = cpu_smol(vocab)
    else:
        raise ValueError(f"workload: unknown {name!r}; choose one of {', '.join(WORKLOADS)}")
    return w.head(num_requests) if num_requests else w
