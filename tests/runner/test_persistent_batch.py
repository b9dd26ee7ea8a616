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
