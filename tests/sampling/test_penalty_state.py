"""Penalties from per-request state on the device equal the per-step formula over each request's
full token history: across many steps, requests coming and going (slots freed and reused), the
rows growing, a batch that fails and is sampled row by row, pending tokens, and whole engines."""

from __future__ import annotations

import random

import pytest
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.core.request import Request
from deepbatch.core.draft_row import DraftRow
from deepbatch.sampling.draft_rows import sampling_rows
from deepbatch.sampling.penalty_state import PenaltyState
from deepbatch.sampling.sampler import Sampler

V = 97


def reference(logits: torch.Tensor, requests: list[Request], history: dict[str, list[int]]) -> torch.Tensor:
    """The penalties recomputed from scratch: repetition over prompt and output tokens (positive
    logits divided, negative multiplied), frequency * count, presence * (count > 0)."""
    out = logits.clone()
    for i, r in enumerate(requests):
        p = r.sampling_params
        if not p.needs_penalties:
            continue
        counts = torch.zeros(logits.shape[1])
        for t in history[r.request_id]:
            counts[t] += 1
        seen = counts > 0
        seen[r.prompt_token_ids] = True
        row = logits[i]
        row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row)
        out[i] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return out


PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def new_request(rng: random.Random, rid: str, penalised: bool = True, prompt_len: int | None = None,
                **kw) -> Request:
    """Random penalties (``kw`` overrides them) unless not ``penalised``."""
    if penalised:
        params = SamplingParams(**{"repetition_penalty": rng.choice([1.0, 1.3, 0.8]),
                                   "frequency_penalty": rng.choice([0.0, 0.7]),
                                   "presence_penalty": rng.choice([0.0, -0.4, 1.1]), **kw})
        if not params.needs_penalties:
            params = SamplingParams(**{**kw, "repetition_penalty": 1.2})
    else:
        params = SamplingParams(**{k: v for k, v in kw.items() if k not in PENALTIES})
    prompt = [rng.randrange(V) for _ in range(prompt_len or rng.randrange(1, 30))]
    return Request(rid, prompt, params, max_tokens=1000)


def random_logits(gen: torch.Generator, rows: int) -> torch.Tensor:
    logits = torch.randn(rows, V, generator=gen) * 3
    logits[:, 5] = float("-inf")  # a banned token stays banned
    return logits


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_matches_full_history_reference_with_requests_coming_and_going(kernel):
    """The torch ops and the Triton kernel (the interpreter on the CPU) against the recomputation."""
    if kernel:
        pytest.importorskip("triton")
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    state = PenaltyState("cpu")
    live: list[Request] = []
    history: dict[str, list[int]] = {}
    peak, with_slots = 0, set()
    for step in range(150):
        # Requests end (their slots freed) and arrive (taking free slots, or growing the rows).
        for r in [r for r in live if rng.random() < 0.08]:
            live.remove(r)
            state.forget(r.request_id)
        for _ in range(rng.randrange(0, 3) if len(live) < 12 else 0):
            r = new_request(rng, f"s{step}-{len(history)}", penalised=rng.random() < 0.8)
            live.append(r)
            history[r.request_id] = []
        if not live:
            continue
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))  # not every request runs each step
        logits = random_logits(gen, len(batch))
        raw = logits.clone()
        got = state.apply(logits, batch, kernel=kernel)
        assert torch.equal(logits, raw)  # a new tensor: the raw logits stay for a row-by-row retry
        if kernel:  # the compiled kernel may contract a product into an FMA
            torch.testing.assert_close(got, reference(logits, batch, history), rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, reference(logits, batch, history)), step
        with_slots.update(r.request_id for r in batch if state.slot_of(r.request_id) is not None)
        sampled = torch.randint(0, V, (len(batch),), generator=gen)
        state.record(sampled, batch)
        for r, t in zip(batch, sampled.tolist()):
            history[r.request_id].append(t)
            r.append_output_token(t)
        peak = max(peak, sum(r.sampling_params.needs_penalties for r in live))
        assert state.num_slots_used == len({r.request_id for r in live if state.slot_of(r.request_id) is not None})
    assert state.num_rows < 2 * peak  # freed slots are reused: the rows follow the live requests
    assert len(with_slots) > 2 * state.num_rows  # many more requests than rows came through


@pytest.mark.parametrize("reserved, expected_rows", [(256, [1, 2, 4, 4, 8]), (3, [1, 2, 3, 4, 5])])
def test_slots_freed_reused_and_grown_without_stale_counts(reserved, expected_rows):
    """Rows double up to the reserved count (what the KV cache sizing set aside), then grow by a
    quarter (at least one row): preempted requests keep slots beyond a full batch."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    state = PenaltyState("cpu", reserved_rows=reserved)
    assert state.num_rows == 0 and state.output_counts is None  # nothing until a penalised request
    plain = new_request(rng, "plain", penalised=False)
    state.apply(random_logits(gen, 1), [plain])
    assert state.num_rows == 0
    reqs = [new_request(rng, f"r{i}") for i in range(5)]
    history = {r.request_id: [] for r in reqs}
    rows_seen = []
    for k in range(1, 6):  # one more request each step
        batch = reqs[:k]
        logits = random_logits(gen, k)
        assert torch.equal(state.apply(logits, batch), reference(logits, batch, history))
        rows_seen.append(state.num_rows)
        sampled = torch.randint(0, V, (k,), generator=gen)
        state.record(sampled, batch)
        for r, t in zip(batch, sampled.tolist()):
            history[r.request_id].append(t)
    assert rows_seen == expected_rows
    slot = state.slot_of("r2")
    # Its step was in flight when it ended: that step's count lands after the free, as a step
    # launched before the free does; the next owner still starts clean.
    state.record(torch.tensor([3]), [reqs[2]])
    state.forget("r2")
    fresh = new_request(rng, "fresh")
    history["fresh"] = []
    logits = random_logits(gen, 2)
    assert torch.equal(state.apply(logits, [fresh, reqs[0]]), reference(logits, [fresh, reqs[0]], history))
    assert state.slot_of("fresh") == slot and state.num_rows == expected_rows[-1]
    assert state.output_counts[slot].sum() == 0
    assert state.prompt_mask[slot].sum() == len(set(fresh.prompt_token_ids))


def test_request_first_sampled_with_outputs_fills_from_them():
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    state = PenaltyState("cpu")
    r = new_request(rng, "late")
    for t in [4, 4, 9]:
        r.append_output_token(t)
    logits = random_logits(gen, 1)
    assert torch.equal(state.apply(logits, [r]), reference(logits, [r], {"late": [4, 4, 9]}))
    # A pending token means an earlier sample, hence a slot; without one its id is unknown.
    other = new_request(rng, "pending")
    other.append_pending_token()
    with pytest.raises(RuntimeError, match="already sampled"):
        state.apply(random_logits(gen, 1), [other])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_draft_rows_see_the_drafts_before_them_and_only_kept_draws_are_counted(kernel):
    """Speculative decoding (``sampling/draft_rows.py``): draft row ``j`` is penalised as if the
    first ``j`` drafts were output tokens; afterwards the counts hold the draws the request keeps
    (up to the first that differs from its draft), not every row's."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    state = PenaltyState("cpu")
    drafting = new_request(rng, "drafting", repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)
    plain = new_request(rng, "plain")
    unpenalised = new_request(rng, "unpenalised", penalised=False)
    for r, outputs in ((drafting, [3, 9]), (plain, [1]), (unpenalised, [2])):
        for t in outputs:
            r.append_output_token(t)
    drafts = [3, 7, 3]
    rows = sampling_rows([drafting, plain, unpenalised], [(0, drafts), (2, [4])])
    logits = random_logits(gen, len(rows))
    got = state.apply(logits, rows, kernel=kernel)
    for i, row in enumerate(rows):
        owner = getattr(row, "request", row)
        history = owner.output_token_ids + (row.drafts[:row.offset] if isinstance(row, DraftRow) else [])
        torch.testing.assert_close(got[i:i + 1], reference(logits[i:i + 1], [owner], {owner.request_id: history}),
                                   rtol=0, atol=1e-6, msg=f"row {i}")
    # Rows: drafting past its 3 drafts, plain, unpenalised past its draft, then drafting's 3 draft
    # rows and unpenalised's 1. Drafting keeps 3 (equal to its draft) and 8 (differs from 7).
    sampled = torch.tensor([9, 11, 12, 3, 8, 3, 4])
    state.record(sampled, rows)
    for rid, history in (("drafting", [3, 9, 3, 8]), ("plain", [1, 11])):
        want = torch.bincount(torch.tensor(history), minlength=V)
        assert state.output_counts[state.slot_of(rid)].tolist() == want.tolist()
    assert state.slot_of("unpenalised") is None


def greedy_run(sampler: Sampler, reqs: list[Request], steps: int, gen: torch.Generator, pending: bool = False):
    """Sample ``steps`` steps as the engine does (each token appended, or pending until after the
    next step's launch); checks every step against the reference's argmax; returns the tokens."""
    history = {r.request_id: [] for r in reqs}
    last = None
    for _ in range(steps):
        logits = random_logits(gen, len(reqs))
        expected = reference(logits, reqs, history).argmax(dim=-1)
        out = sampler.sample(logits, reqs)
        if last is not None:  # commit the previous step after this one's launch
            for r, t in zip(reqs, last.resolve().token_ids):
                r.commit_pending_token(t)
        tokens = out.resolve().token_ids
        assert tokens == expected.tolist()
        for r, t in zip(reqs, tokens):
            history[r.request_id].append(t)
            if pending:
                r.append_pending_token()
            else:
                r.append_output_token(t)
        last = out if pending else None
    return history


@pytest.mark.parametrize("pending", [False, True], ids=["sync", "pending"])
def test_sampler_greedy_matches_reference(pending):
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    reqs = [new_request(rng, f"r{i}", penalised=i != 1, temperature=0.0, frequency_penalty=1.5) for i in range(4)]
    sampler = Sampler(V, "cpu")
    history = greedy_run(sampler, reqs, 40, gen, pending)
    for r in reqs[::2]:
        slot = sampler.penalties.slot_of(r.request_id)
        assert sampler.penalties.output_counts[slot].sum() == len(history[r.request_id])


class FailingBatchSampler(Sampler):
    """Sampling a batch of several rows raises after the penalties were applied (and new slots
    filled); each row alone works."""

    def _sample(self, logits, requests, step):
        if len(requests) > 1:
            raise RuntimeError("batch failure")
        return super()._sample(logits, requests, step)


def test_batch_failure_counts_final_ids_once():
    rng = random.Random(4)
    params = {"temperature": 0.9, "frequency_penalty": 2.0}
    runs = []
    for cls in (Sampler, FailingBatchSampler):
        reqs = [new_request(random.Random(i), f"r{i}", seed=i, **params) for i in range(3)]
        reqs.append(new_request(rng, "plain", penalised=False, temperature=0.9, seed=9))
        sampler = cls(V, "cpu")
        gen = torch.Generator().manual_seed(5)
        tokens = []
        for _ in range(25):
            out = sampler.sample(random_logits(gen, len(reqs)), reqs).resolve()
            assert out.errors is None
            tokens.append(out.token_ids)
            for r, t in zip(reqs, out.token_ids):
                r.append_output_token(t)
        for r in reqs[:3]:  # counted once per step, not once per pass
            counts = sampler.penalties.output_counts[sampler.penalties.slot_of(r.request_id)]
            assert counts.tolist() == torch.bincount(torch.tensor(r.output_token_ids), minlength=V).tolist()
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_failed_row_is_not_counted():
    rng, gen = random.Random(6), torch.Generator().manual_seed(6)
    reqs = [new_request(rng, "ok", temperature=0.0), new_request(rng, "victim", temperature=0.0)]
    sampler = Sampler(V, "cpu", fault_request_id="victim")
    out = sampler.sample(random_logits(gen, 2), reqs).resolve()
    assert list(out.errors) == [1]
    assert sampler.penalties.output_counts[sampler.penalties.slot_of("ok")].sum() == 1
    assert sampler.penalties.slot_of("victim") is None


def test_no_history_copied_per_step(monkeypatch):
    """After a request's first step, a step copies to the device only per-row values (a few per
    row), never a prompt or the outputs so far."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    reqs = [new_request(rng, f"r{i}", prompt_len=300, temperature=0.0) for i in range(3)]
    sampler = Sampler(V, "cpu")
    sizes = []
    real = torch.tensor

    def counting(data, *args, **kwargs):
        t = real(data, *args, **kwargs)
        sizes.append(t.numel())
        return t

    history = {r.request_id: [] for r in reqs}
    for step in range(30):
        sizes.clear()
        monkeypatch.setattr(torch, "tensor", counting)
        logits = random_logits(gen, len(reqs))
        tokens = sampler.sample(logits, reqs).resolve().token_ids
        monkeypatch.setattr(torch, "tensor", real)
        assert tokens == reference(logits, reqs, history).argmax(dim=-1).tolist()
        if step == 0:
            assert max(sizes) >= 300  # the fill: once per request
        else:
            # three values per row, the rows padded to a multiple of 4 (sampling/host_copy.py)
            assert max(sizes, default=0) <= 3 * (len(reqs) + 3), (step, sizes)
        for r, t in zip(reqs, tokens):
            r.append_output_token(t)
            history[r.request_id].append(t)


# -- engines --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["qwen2"], dtype="float32", device="cpu", max_model_len=256, block_size=8,
               num_gpu_blocks_override=12)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_frees_every_slot(llm, async_scheduling):
    """n > 1 samples hold a slot each; requests that stop while the next step is in flight,
    hit max_tokens or are preempted free theirs when they end."""
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    state = engine.runner.sampler.penalties
    params = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.2, stop_token_ids=[40 + i]) for i in range(4)]
    params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))  # no slot
    prompts = [{"prompt_token_ids": [11 + i] * (9 + 5 * i)} for i in range(5)]
    used = []
    real = state.record

    def watching(sampled, requests, skip=None):
        real(sampled, requests, skip)
        used.append(state.num_slots_used)

    state.record = watching
    try:
        engine.scheduler.num_preemptions = 0
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del state.record
    assert engine.scheduler.num_preemptions > 0
    assert all(len(o.outputs) == 2 for o in outs[:4])
    assert max(used) > 2 and state.num_slots_used == 0
    assert state.num_rows <= 8  # at most 8 penalised samples alive at once, in power-of-two rows
