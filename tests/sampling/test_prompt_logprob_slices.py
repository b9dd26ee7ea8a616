"""``sampling/prompt_logprobs.py`` on hand-made logits, against torch's log-softmax: the rows of
several requests' chunks, in slices when the vocabulary makes a step's rows too many floats; a
tensor-parallel worker (whose ``compute_logits`` returns None) makes the same calls and gets
nothing; ``prompt_logprobs`` is validated like ``logprobs``."""

from __future__ import annotations

import pytest
import torch

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams, SamplingParamsError
from deepbatch.sampling import prompt_logprobs as plp

VOCAB = 50


def request(rid: str, n: int, k: int | None, seed: int) -> Request:
    g = torch.Generator().manual_seed(seed)
    return Request(rid, torch.randint(0, VOCAB, (n,), generator=g).tolist(), SamplingParams(prompt_logprobs=k), 4)


def rows_of(chunks):
    """``chunks``: (request, start, end) in step order; flat rows follow one another."""
    out, row = [], 0
    for r, start, end in chunks:
        rows = plp.prompt_logprob_rows(r, start, end, row)
        if rows is not None:
            out.append(rows)
        row += end - start
    return out, row


def test_rows_stop_before_the_last_prompt_token_and_skip_requests_that_do_not_ask():
    a, plain = request("a", 10, 2, 0), request("plain", 10, None, 1)
    segments, _ = rows_of([(a, 4, 10), (plain, 0, 10), (a, 0, 4)])
    assert [(s.request.request_id, s.start, s.row, s.count) for s in segments] == [("a", 4, 0, 5), ("a", 0, 16, 4)]
    assert plp.prompt_logprob_rows(a, 9, 10, 0) is None  # the last prompt position: its next token is sampled
    assert plp.prompt_logprob_rows(a, 10, 11, 0) is None  # an output position (a rerun after recompute)


@pytest.mark.parametrize("max_elements", [1 << 24, 3 * VOCAB, 1])
def test_entries_match_log_softmax_in_any_slicing(monkeypatch, max_elements):
    monkeypatch.setattr(plp, "_MAX_LOGIT_ELEMENTS", max_elements)
    a, b, c = request("a", 9, 3, 0), request("b", 6, 0, 1), request("c", 5, None, 2)
    segments, num_rows = rows_of([(c, 0, 5), (b, 0, 6), (a, 5, 9)])
    hidden = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    calls = []

    def compute_logits(h):
        calls.append(h.shape[0])
        return h * 1.0  # the "model": hidden rows are the logits

    pending = plp.compute_prompt_logprobs(compute_logits, hidden, segments, VOCAB)
    got = pending.resolve()
    assert sum(calls) == 5 + 3 and max(calls) <= max(1, max_elements // VOCAB)
    # a's chunk (positions 5..8) ends on its last prompt token: positions 5..7 only; b's too.
    assert {rid: (start, len(e)) for rid, (start, e) in got.items()} == {"a": (5, 3), "b": (0, 5)}
    ref = torch.log_softmax(hidden, dim=-1)
    for r, first_row in ((a, 11), (b, 5)):
        start, entries = got[r.request_id]
        for j, (logprob, rank, top) in enumerate(entries):
            row = ref[first_row + j]
            target = r.prompt_token_ids[start + j + 1]
            assert logprob == pytest.approx(row[target].item(), abs=1e-6)
            assert rank == int((row > row[target]).sum()) + 1
            k = r.sampling_params.prompt_logprobs
            assert list(top) == (row.topk(k).indices.tolist() if k else [])


def test_a_worker_makes_the_same_calls_and_gets_nothing(monkeypatch):
    monkeypatch.setattr(plp, "_MAX_LOGIT_ELEMENTS", 2 * VOCAB)
    segments, num_rows = rows_of([(request("a", 8, 1, 0), 0, 8)])
    calls = []
    worker = plp.compute_prompt_logprobs(lambda h: calls.append(h.shape[0]), torch.zeros(num_rows, 4), segments,
                                         VOCAB)
    assert worker is None and calls == [2, 2, 2, 1]


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "2"])
def test_prompt_logprobs_is_validated_like_logprobs(value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"


def test_prompt_logprobs_bounds_are_accepted():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
