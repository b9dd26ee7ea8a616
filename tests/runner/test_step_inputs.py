"""A step's inputs (``runner/step_inputs.py``) against their definitions, token by token, over
random steps that mix decodes (known and pending ids), verification chunks with drafts, short
and long prefill chunks, chunks that do not reach the newest token, and requests that come and go."""

from __future__ import annotations

import random

import torch

from deepbatch.core.request import Request
from deepbatch.core.sampling_params import SamplingParams
from deepbatch.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepbatch.runner.persistent_batch import PersistentBatch
from deepbatch.runner.step_inputs import SHORT_CHUNK, step_inputs

BS = 4


def new_request(rng: random.Random, i: int) -> Request:
    n = rng.randrange(2, 90)
    r = Request(f"r{i}", [rng.randrange(1, 1000) for _ in range(n)], SamplingParams(temperature=0.0), 500)
    r.block_ids = rng.sample(range(1, 1000), -(-(n + 40) // BS))
    return r


def schedule_one(rng: random.Random, r: Request, pool_ids: dict[str, int]) -> ScheduledRequest:
    """Move ``r`` (no pending token, its newest token not computed) to a random state and schedule
    a chunk of it."""
    r.spec_token_ids = []
    remaining = r.num_tokens - r.num_computed_tokens
    kind = rng.random()
    if remaining > 1 and kind < 0.5:  # a prefill chunk, long or short, reaching the newest token or not
        return ScheduledRequest(r, rng.choice([rng.randrange(1, remaining + 1), remaining,
                                               min(remaining, SHORT_CHUNK + 3)]))
    if kind < 0.7:  # a decode whose input is pending: sampled by the step in flight
        r.num_pending_tokens = 1
        pool_ids[r.request_id] = rng.randrange(1, 1000)
    r.num_computed_tokens = r.num_tokens - 1  # at the newest token: decode or verify
    if kind >= 0.85:
        k = rng.randrange(1, 5)
        r.spec_token_ids = [rng.randrange(1, 1000) for _ in range(k)]
        return ScheduledRequest(r, 1 + k)
    return ScheduledRequest(r, 1)


def advance(s: ScheduledRequest, pool_ids: dict[str, int], rng: random.Random) -> None:
    """After the step: the chunk is computed, a pending id committed, a sampled one appended."""
    r = s.request
    if r.num_pending_tokens:
        r.num_pending_tokens = 0
        r.all_token_ids.append(pool_ids[r.request_id])
    if s.samples:
        r.all_token_ids.append(rng.randrange(1, 1000))
        r.num_computed_tokens = r.num_tokens - 1
    else:
        r.num_computed_tokens += s.num_new_tokens


def reference(out: SchedulerOutput, pool_ids: dict[str, int], rows: dict[str, int]) -> dict[str, list]:
    ref = {k: [] for k in ("ids", "positions", "slots", "seq_lens", "logits", "spec", "sample_rows", "drafts")}
    at = 0
    for s in out.scheduled:
        r = s.request
        for p in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
            known = len(r.all_token_ids)
            ref["ids"].append(r.all_token_ids[p] if p < known else pool_ids[r.request_id] if p < r.num_tokens
                              else r.spec_token_ids[p - r.num_tokens])
            ref["positions"].append(p)
            ref["slots"].append(r.block_ids[p // BS] * BS + p % BS)
        ref["seq_lens"].append(r.num_computed_tokens + s.num_new_tokens)
        if s.samples:
            ref["logits"].append(at + s.num_new_tokens - 1)
            ref["sample_rows"].append(rows[r.request_id])
            first_draft = at + s.num_new_tokens - 1 - s.num_spec_tokens
            ref["spec"] += range(first_draft, first_draft + s.num_spec_tokens)
            ref["drafts"] += [rows[r.request_id]] * s.num_spec_tokens
        at += s.num_new_tokens
    ref["logits"] += ref.pop("spec")
    ref["sample_rows"] += ref.pop("drafts")
    return ref


def test_step_inputs_follow_their_definitions():
    rng = random.Random(0)
    pool = PersistentBatch(4, torch.device("cpu"), max_blocks_per_seq=2)
    live: list[Request] = []
    kinds = set()
    for step in range(300):
        while len(live) < 6 or rng.random() < 0.1:
            live.append(new_request(rng, step * 10 + len(live)))
        for r in [r for r in live if rng.random() < 0.05 or r.num_tokens + 6 > len(r.block_ids) * BS]:
            live.remove(r)  # ended, or its blocks are full: its row goes to a new request
            pool.release(r.request_id)
        pool_ids: dict[str, int] = {}
        out = SchedulerOutput([schedule_one(rng, r, pool_ids) for r in rng.sample(live, rng.randrange(1, len(live)))])
        rows = {s.request.request_id: pool.row(s.request.request_id) for s in out.scheduled}
        if pool_ids:
            pool.record_sampled(torch.tensor([rows[i] for i in pool_ids]), torch.tensor(list(pool_ids.values())))
        inputs = step_inputs(out, BS, pool, torch.device("cpu"))
        b, ref = inputs.batch, reference(out, pool_ids, rows)
        assert b.input_ids.tolist() == ref["ids"], step
        assert b.positions.tolist() == ref["positions"], step
        assert b.slot_mapping.tolist() == ref["slots"], step
        assert b.seq_lens.tolist() == ref["seq_lens"], step
        q_lens = [s.num_new_tokens for s in out.scheduled]
        assert b.query_start_loc.tolist() == [sum(q_lens[:i]) for i in range(len(q_lens) + 1)], step
        assert b.logits_indices.tolist() == ref["logits"], step
        assert inputs.sample_rows.tolist() == ref["sample_rows"], step
        n = len(ref["sample_rows"])
        assert inputs.sample_rows_device[:n].tolist() == ref["sample_rows"], step
        assert inputs.sample_rows_device.shape[0] % 4 == 0, step
        for s, table in zip(out.scheduled, b.block_tables.tolist()):
            blocks = s.request.block_ids
            assert table == blocks + [0] * (len(table) - len(blocks)), step
        kinds.update((s.num_new_tokens > SHORT_CHUNK, s.num_spec_tokens > 0, s.samples,
                      bool(s.request.num_pending_tokens)) for s in out.scheduled)
        for s in out.scheduled:
            advance(s, pool_ids, rng)
    # Every kind of chunk was met: long prefill chunks that sample or not, verification chunks,
    # pending decodes, short chunks short of the newest token.
    assert {(True, False, True, False), (True, False, False, False), (False, True, True, False),
            (False, False, True, True), (False, False, False, False)} <= kinds
