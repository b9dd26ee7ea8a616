"""Tiny tokenizers built on the spot (no download): byte-level BPE trained on a few sentences,
with the think tags as added special tokens, as in the Qwen3 and DeepSeek-R1 tokenizers."""

from __future__ import annotations

import pytest

CORPUS = [
    "Okay, the user asks for 2 + 2. That is 4, so the answer is simple.",
    "Let me think about this carefully. First, the capital of France is Paris.",
    "The answer is 4. I hope that helps! Hmm, wait: x < y and y > z.",
    "東京 café crème 🚀 {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
]
DEEPSEEK_SPECIAL = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
]


def build(special_tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    return build(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"])


@pytest.fixture(scope="session")
def deepseek_tokenizer():
    return build(DEEPSEEK_SPECIAL + ["<think>", "</think>"])


@pytest.fixture(scope="session")
def plain_tokenizer():
    return build(["<|endoftext|>"])
