"""The text workload of ``deepbatch bench`` (``copy-heavy``): real text, the same requests on every
run, each of the three tasks present, and a clear error without a tokenizer."""

from __future__ import annotations

import pytest

from deepbatch.bench.workloads import make_workload


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_copy_heavy_is_real_text_and_the_same_every_time():
    a = make_workload("copy-heavy", 256, 9, tokenizer=ByteTokenizer())
    b = make_workload("copy-heavy", 256, 9, tokenizer=ByteTokenizer())
    assert a == b and a.num_requests == 9 and set(a.output_lens) == {128} and a.temperature == 0.0
    texts = [bytes(p).decode() for p in a.prompts]
    assert sum("def " in t and "type hints" in t for t in texts) == 3  # code edits
    assert sum(t.endswith("Quote:") for t in texts) == 3  # answers quoted from a document
    assert sum(t.endswith("Summary:") for t in texts) == 3
    assert len(set(texts)) >= 7  # several functions and documents, not one repeated


def test_copy_heavy_needs_the_models_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        make_workload("copy-heavy", 256, 4)
