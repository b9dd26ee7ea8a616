"""The bitmask's device apply against xgrammar's kernel and a per-bit reference, the min_tokens
fold, and the matcher's bookkeeping: pending tokens, rejected tokens, replay, start_after."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import xgrammar

from deepbatch.core.sampling_params import SamplingParams, StructuredOutputsParams
from deepbatch.sampling.draft_rows import sampling_rows
from deepbatch.sampling.pending_sample import SamplerOutput
from deepbatch.structured_output.bitmask import (_ban_until_min_tokens, apply_bitmask, apply_bitmask_torch,
                                                 apply_grammar_bitmask, unpack_bitmask)
from deepbatch.structured_output.grammar import GrammarCache
from deepbatch.structured_output.matcher import StructuredOutputRequest


def reference_mask(logits, bitmask, rows):
    out = logits.clone()
    for i in rows:
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 1000])
def test_torch_and_xgrammar_apply_match_a_per_bit_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31, (4, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1, -1] = -2**31  # only bit 31 of the last word: the sign bit
    logits = torch.randn(4, vocab, generator=g)
    rows = [0, 1, 3]  # row 2 is unconstrained and must stay as it was
    expected = reference_mask(logits, bitmask, rows)
    for apply in (apply_bitmask_torch, apply_bitmask):
        got = logits.clone()
        apply(got, bitmask, rows)
        assert torch.equal(got, expected), apply.__name__
    unpacked = unpack_bitmask(bitmask, vocab)
    assert torch.equal(~unpacked[rows], torch.isinf(expected[rows]))


def row_of(allowed: list[int], words: int = 4) -> torch.Tensor:
    row = torch.zeros(words, dtype=torch.int32)
    for t in allowed:
        row[t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return row


def fake_request(num_output_tokens, **params):
    return SimpleNamespace(num_output_tokens=num_output_tokens,
                           sampling_params=SamplingParams(**params, _eos_token_ids=frozenset({2, 31})))


def allowed_of(row):
    return set(unpack_bitmask(row.unsqueeze(0), 128)[0].nonzero().flatten().tolist())


def test_min_tokens_clears_eos_and_stop_ids_unless_the_grammar_allows_nothing_else():
    row = row_of([2, 31, 40, 63, 90])
    _ban_until_min_tokens(row, fake_request(1, min_tokens=3, stop_token_ids=[63]))
    assert allowed_of(row) == {40, 90}
    row = row_of([2, 31, 40])
    _ban_until_min_tokens(row, fake_request(1, min_tokens=3, ignore_eos=True))
    assert allowed_of(row) == {2, 31, 40}  # EOS is not a stop with ignore_eos
    row = row_of([2, 31])
    _ban_until_min_tokens(row, fake_request(0, min_tokens=3))
    assert allowed_of(row) == {2, 31}  # only EOS may follow: the grammar wins over min_tokens
    row = row_of([2, 40])
    _ban_until_min_tokens(row, fake_request(3, min_tokens=3))
    assert allowed_of(row) == {2, 40}


@pytest.fixture(scope="module")
def grammars(smollm_llm):
    e = smollm_llm.engine
    return GrammarCache(e.tokenizer, e.hf_config.vocab_size, e.eos_token_ids), e.tokenizer


class FakeStep:
    """A launched step's sampled ids, as the sampler's PendingSample resolves them."""

    def __init__(self, token_ids, errors=None):
        self.out = SamplerOutput(token_ids, None, errors)

    def resolve(self):
        return self.out


def bits(state, vocab):
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    state.fill_bitmask(bitmask, 0)
    return bitmask


def test_matcher_reads_a_pending_token_from_its_step(grammars):
    cache, tok = grammars
    ids = tok.encode("12345", add_special_tokens=False)
    state = StructuredOutputRequest(cache.compile(StructuredOutputsParams(regex=r"\d{5}")))
    assert state.advance(ids[:-1]) is None and state.num_seen == len(ids) - 1
    state.last_sample = (FakeStep([99, ids[-1]]), 1)
    assert state.advance(ids[:-1], num_pending=1) is None and state.num_seen == len(ids)
    assert state.matcher.is_completed() and not state.is_terminated
    # The commit finds the token already seen; EOS then terminates the grammar.
    assert state.advance(ids) is None and state.num_seen == len(ids)
    assert state.advance(ids + [2]) is None and state.is_terminated and not state.constrains_next_token


def test_pending_token_of_a_failed_row_is_left_for_the_commit(grammars):
    cache, _ = grammars
    state = StructuredOutputRequest(cache.compile(StructuredOutputsParams(regex=r"\d+")))
    state.last_sample = (FakeStep([7], errors={0: "NaN logits"}), 0)
    assert state.advance([], num_pending=1) is None and state.num_seen == 0 and state.error is None


def test_rejected_token_is_the_requests_error(grammars):
    cache, tok = grammars
    state = StructuredOutputRequest(cache.compile(StructuredOutputsParams(regex=r"\d+")))
    error = state.advance(tok.encode("x", add_special_tokens=False))
    assert error is not None and "does not continue the regex grammar" in error
    assert not state.constrains_next_token


def test_shorter_output_replays_the_tokens_kept(grammars):
    cache, tok = grammars
    grammar = cache.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}}))
    ids = tok.encode("[12, 3", add_special_tokens=False)
    state = StructuredOutputRequest(grammar)
    state.advance(ids)
    kept = ids[:2]
    state.advance(kept)
    fresh = StructuredOutputRequest(grammar)
    fresh.advance(kept)
    assert state.num_seen == 2
    assert torch.equal(bits(state, cache.vocab_size), bits(fresh, cache.vocab_size))


def test_start_after_frees_the_prefix_and_starts_fresh(grammars):
    cache, tok = grammars
    grammar = cache.compile(StructuredOutputsParams(regex=r"[0-9]+"))
    marker = tok.encode("</think>", add_special_tokens=False)
    assert len(marker) > 1
    state = StructuredOutputRequest(grammar, tuple(marker))
    free = tok.encode("hello </ think", add_special_tokens=False)
    assert state.advance(free + marker[:1]) is None and not state.constrains_next_token
    assert state.advance(free + marker) is None and state.constrains_next_token
    digits = tok.encode("42", add_special_tokens=False)
    assert state.advance(free + marker + digits) is None
    fresh = StructuredOutputRequest(grammar)
    fresh.advance(digits)
    assert torch.equal(bits(state, cache.vocab_size), bits(fresh, cache.vocab_size))
    assert state.advance(free + marker + digits + marker) is not None  # the grammar holds from there on


def test_apply_grammar_bitmask_masks_only_constrained_rows(grammars):
    cache, tok = grammars
    vocab = cache.vocab_size

    def request(state, output=()):
        return SimpleNamespace(structured_output=state, output_token_ids=list(output), num_output_tokens=len(output),
                               num_pending_tokens=0,
                               sampling_params=SamplingParams(_eos_token_ids=frozenset(cache.stop_token_ids)))

    digits = StructuredOutputRequest(cache.compile(StructuredOutputsParams(regex=r"[0-9]{2}")))
    waiting = StructuredOutputRequest(digits.grammar, (5,))
    broken = StructuredOutputRequest(digits.grammar)
    requests = [request(None), request(digits, tok.encode("7", add_special_tokens=False)), request(waiting),
                request(broken, tok.encode("a", add_special_tokens=False))]
    logits = torch.zeros(4, vocab)
    assert apply_grammar_bitmask(logits, requests) == {1}
    allowed = (~torch.isinf(logits[1])).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)
    assert not torch.isinf(logits[[0, 2, 3]]).any()
    assert broken.error is not None and digits.error is None


def test_draft_rows_are_masked_as_the_request_after_each_draft(grammars):
    """Speculative decoding: draft row ``j`` is masked as the request would be with its first
    ``j`` drafts taken; rows past a draft the grammar refuses stay unmasked (they are not kept);
    the matcher is back at the request's newest token afterwards."""
    cache, tok = grammars
    vocab = cache.vocab_size
    grammar = cache.compile(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}}))
    output = tok.encode("[1, ", add_special_tokens=False)
    valid = tok.encode("23, 4", add_special_tokens=False)
    drafts = valid + tok.encode("x", add_special_tokens=False)[:1] + valid[:1]

    def request(text_ids):
        return SimpleNamespace(structured_output=StructuredOutputRequest(grammar), output_token_ids=list(text_ids),
                               num_output_tokens=len(text_ids), num_pending_tokens=0,
                               sampling_params=SamplingParams(_eos_token_ids=frozenset(cache.stop_token_ids)))

    r = request(output)
    rows = sampling_rows([r], [(0, drafts)])
    logits = torch.zeros(len(rows), vocab)
    masked = apply_grammar_bitmask(logits, rows)
    by_offset = {row.offset: i for i, row in enumerate(rows)}
    assert masked == {by_offset[j] for j in range(len(valid) + 1)}
    for j in range(len(valid) + 1):  # up to the row in place of the refused draft
        alone = torch.zeros(1, vocab)
        apply_grammar_bitmask(alone, [request(output + drafts[:j])])
        assert torch.equal(torch.isinf(logits[by_offset[j]]), torch.isinf(alone[0])), j
    for j in range(len(valid) + 1, len(drafts) + 1):
        assert not torch.isinf(logits[by_offset[j]]).any(), j
    fresh = StructuredOutputRequest(grammar)
    fresh.advance(output)
    assert r.structured_output.num_seen == len(output)
    assert torch.equal(bits(r.structured_output, vocab), bits(fresh, vocab))


def test_batched_fill_equals_each_row_alone_and_a_faulty_row_fails_alone(grammars):
    """Several grammars at different points filled by xgrammar's batched matcher: each row's mask
    is the mask its matcher fills alone. A matcher that raises sends the step row by row, and only
    its request gets the error."""
    cache, tok = grammars
    vocab = cache.vocab_size

    def request(spec, text):
        state = StructuredOutputRequest(cache.compile(spec))
        out = tok.encode(text, add_special_tokens=False) if text else []
        return SimpleNamespace(structured_output=state, output_token_ids=out, num_output_tokens=len(out),
                               num_pending_tokens=0,
                               sampling_params=SamplingParams(_eos_token_ids=frozenset(cache.stop_token_ids)))

    specs = [(StructuredOutputsParams(regex=r"[0-9]{2,5}"), "12"),
             (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}}), "[1, "),
             (StructuredOutputsParams(choice=["yes", "no"]), ""),
             (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                            "required": ["a"]}), '{"a": "x')]
    batch = [request(*s) for s in specs]
    logits = torch.zeros(len(batch), vocab)
    assert apply_grammar_bitmask(logits, batch) == {0, 1, 2, 3}
    for i, spec in enumerate(specs):
        alone = request(*spec)
        one = torch.zeros(1, vocab)
        apply_grammar_bitmask(one, [alone])
        assert torch.equal(torch.isinf(logits[i]), torch.isinf(one[0])), i

    class Broken:
        def is_terminated(self):
            return False

        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("matcher state lost")

    batch = [request(*s) for s in specs]
    for r in batch:
        r.structured_output.advance(r.output_token_ids)
    batch[2].structured_output.matcher = Broken()
    logits = torch.zeros(len(batch), vocab)
    assert apply_grammar_bitmask(logits, batch) == {0, 1, 3}
    assert "matcher state lost" in batch[2].structured_output.error
    assert all(batch[i].structured_output.error is None for i in (0, 1, 3))
    assert not torch.isinf(logits[2]).any() and torch.isinf(logits[[0, 1, 3]]).any(dim=1).all()
