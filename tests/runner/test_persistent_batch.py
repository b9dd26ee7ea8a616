"""The runner's persistent rows and device token pool (``runner/persistent_batch.py``), alone and
inside the runner: a request keeps its row across steps, a released row goes to the next new
request, the pool grows without losing ids, and a pending input is read from the pool."""

from __future__ import annotations

import torch

from deepbatch import LLM, SamplingParams
from deepbatch.runner.persistent_batch import PersistentBatch


def test_rows_are_kept_released_and_reused():
    batch = PersistentBatch(2, torch.device("cpu"))
    a, b = batch.row("a"), batch.row("b")
    assert {a, b} == {0, 1} and batch.row("a") == a and len(batch) == 2
    batch.release("a")
    batch.release("a")  # twice: a no-op
    assert batch.row("c") == a and len(batch) == 2


def test_pool_grows_and_keeps_the_ids_it_holds():
    batch = PersistentBatch(2, torch.device("cpu"))
    rows = [batch.row(r) for r in "ab"]
    batch.record_sampled(torch.tensor(rows), torch.tensor([7, 9], dtype=torch.int32))
    extra = [batch.row(r) for r in "cde"]  # past the capacity: the pool doubles
    assert batch.token_pool.shape[0] == 8 and len(set(rows + extra)) == 5
    batch.record_sampled(torch.tensor(extra), torch.tensor([1, 2, 3]))
    input_ids = torch.zeros(4, dtype=torch.long)
    batch.read_pending(input_ids, torch.tensor([3, 0, 2]), torch.tensor([rows[1], rows[0], extra[2]]))
    assert input_ids.tolist() == [7, 0, 3, 9]


def test_pending_inputs_come_from_the_pool(tiny_checkpoints, monkeypatch):
    """Under async scheduling every decode input whose id is not on the host yet is read from
    the request's row of the pool, and the output equals synchronous steps'."""
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=128, block_size=8)
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + 2 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    engine.async_scheduling = False
    sync = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reads = []
    batch = engine.runner.batch
    real = batch.read_pending
    monkeypatch.setattr(batch, "read_pending", lambda ids, pos, rows: (reads.append(len(rows)), real(ids, pos, rows)))
    engine.async_scheduling = True
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == sync
    # Every decode step after the first reads its inputs from the pool: 3 requests x 11 decodes.
    assert sum(reads) == 3 * 11
    assert len(batch) == 0


def reference_tables(block_lists: list[list[int]]) -> list[list[int]]:
    """The table a step built on the host: each request's blocks, then zeros."""
    width = max(1, *(len(b) for b in block_lists))
    return [b + [0] * (width - len(b)) for b in block_lists]


def step_tables(batch: PersistentBatch, requests: dict[str, list[int]]) -> list[list[int]]:
    """What ``step_inputs`` does with the persistent batch for a step of ``requests``."""
    updates = ([], [], [])
    rows = []
    for rid, block_ids in requests.items():
        rows.append(batch.row(rid))
        batch.table_updates(rows[-1], block_ids, updates)
    if updates[0]:
        batch.apply_table_updates(torch.tensor(updates[0]), torch.tensor(updates[1]),
                                  torch.tensor(updates[2], dtype=torch.int32))
    width = max(1, *(len(b) for b in requests.values()))
    return batch.block_tables(torch.tensor(rows), width).tolist()


def test_block_tables_follow_every_change_by_their_updates():
    """Appended blocks, a request allocated afresh (preemption: a new list, shorter or longer),
    sliding-window releases (NULL_BLOCK entries, a prefix), rows that change owner, a pool that
    grows and a table that widens: the gathered tables equal the ones built on the host every
    step, and a step where nothing changed sends nothing."""
    import random

    from deepbatch.kv_cache.manager import NULL_BLOCK

    rng = random.Random(0)
    batch = PersistentBatch(2, torch.device("cpu"), max_blocks_per_seq=3)
    live: dict[str, list[int]] = {}
    next_id = 0
    for step in range(400):
        op = rng.random()
        if op < 0.15 or not live:  # a new request
            live[f"r{next_id}"] = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 5))]
            next_id += 1
        elif op < 0.25:  # one ends: its row goes to the next new request
            rid = rng.choice(sorted(live))
            del live[rid]
            batch.release(rid)
        elif op < 0.35:  # preempted and allocated afresh
            rid = rng.choice(sorted(live))
            live[rid] = [rng.randrange(1, 500) for _ in range(rng.randrange(0, 8))]
        elif op < 0.45:  # a sliding window lets the oldest live blocks go, in place
            rid = rng.choice(sorted(live))
            b = live[rid]
            first = next((i for i, x in enumerate(b) if x != NULL_BLOCK), len(b))
            k = min(rng.randrange(1, 3), len(b) - first)
            b[first:first + k] = [NULL_BLOCK] * k
        else:  # some grow, in place
            for rid in rng.sample(sorted(live), k=max(1, len(live) // 2)):
                live[rid].extend(rng.randrange(1, 500) for _ in range(rng.randrange(0, 3)))
        if not live:
            continue
        scheduled = {rid: live[rid] for rid in rng.sample(sorted(live), k=rng.randrange(1, len(live) + 1))}
        assert step_tables(batch, scheduled) == reference_tables(list(scheduled.values())), step
    assert batch.block_table.shape[0] > 2 and batch.block_table.shape[1] > 3  # grown and widened
    # Nothing changed: no entry is sent.
    updates = ([], [], [])
    for rid in scheduled:
        batch.table_updates(batch.row(rid), live[rid], updates)
    assert updates == ([], [], [])
