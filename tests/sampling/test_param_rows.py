"""The persistent batch's sampling-parameter rows (``sampling/param_rows.py``): a step's gathered
columns and kernel hints equal the ones built from its requests' parameters, over rows that change
owner, a table that grows, and steps that send nothing; and the engine samples through them."""

from __future__ import annotations

import random

import numpy as np
import torch

from deepbatch import LLM, SamplingParams
from deepbatch.runner.persistent_batch import PersistentBatch
from deepbatch.sampling.param_rows import FLOAT_COLUMNS, INT_COLUMNS, StepParams

VOCAB = 100


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
        top_k=rng.choice([-1, 1, 5, VOCAB, VOCAB + 3]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        seed=rng.choice([None, None, 0, 2**64 - 1, 12345]),
    )


def expected_hints(params: list[SamplingParams]) -> tuple[dict, bool, bool, bool]:
    """The hints, from the parameters' own definitions: over the sampled (not greedy) rows, the
    largest top-k in (0, V), any top-p < 1, any min-p > 0; whether every sampled row is plain
    temperature; whether every row is greedy; whether any row has a seed."""
    sampled = [p for p in params if not p.greedy]
    hints = dict(max_top_k=max((p.top_k for p in sampled if 0 < p.top_k < VOCAB), default=0),
                 any_top_p=any(p.top_p < 1.0 for p in sampled), any_min_p=any(p.min_p > 0.0 for p in sampled))
    plain = all((p.top_k <= 0 or p.top_k >= VOCAB) and p.top_p >= 1.0 and p.min_p <= 0.0 and p.seed is None
                for p in sampled)
    return hints, plain, not sampled, any(p.seed is not None for p in params)


def columns(step: StepParams) -> dict[str, list]:
    return {name: step.column(name).tolist() for name in FLOAT_COLUMNS + INT_COLUMNS}


def test_gathered_rows_equal_the_rows_built_from_the_parameters():
    rng = random.Random(0)
    batch = PersistentBatch(2, torch.device("cpu"))
    live: dict[str, SamplingParams] = {}
    sent_nothing = 0
    for step in range(300):
        if rng.random() < 0.3 or not live:
            live[f"r{step}"] = random_params(rng)
        elif rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            del live[rid]
            batch.release(rid)  # its row goes to the next new request
            if not live:
                continue
        scheduled = rng.sample(sorted(live), k=rng.randrange(1, len(live) + 1))
        # As ``step_inputs``: each request's row, its values written where the row does not hold
        # them yet, the rows padded to a multiple of 4.
        rows = [batch.row(rid) for rid in scheduled]
        written = [(row, live[rid]) for rid, row in zip(scheduled, rows) if batch.params.sent[row] is not live[rid]]
        for row, params in written:
            batch.params.write(row, params)
        sent_nothing += not written
        padded_rows = torch.tensor(rows + [0] * (-len(rows) % 4))
        gathered = StepParams.gather(batch.params, np.asarray(rows), padded_rows)
        params = [live[rid] for rid in scheduled]
        built = StepParams.of(params, torch.device("cpu"))
        if rng.random() < 0.5:  # a step that reads the device columns (a greedy one reads none)
            assert columns(gathered) == columns(built), step
        hints, plain, all_greedy, any_seeded = expected_hints(params)
        for s in (gathered, built):
            assert s.hints(VOCAB) == hints and s.temperature_only(VOCAB) == plain, step
            assert s.all_greedy == all_greedy and s.any_seeded == any_seeded, step
    assert batch.params.floats.shape[1] > 2  # grown with the pool
    assert sent_nothing > 50  # a step of requests that hold their rows sends no values


def test_gathered_columns_start_aligned():
    """Triton compiles a kernel per alignment class of its pointers: every column of a step's
    parameters starts 16-byte aligned, whatever the number of rows."""
    batch = PersistentBatch(8, torch.device("cpu"))
    for n in range(1, 8):
        rows = list(range(n))
        step = StepParams.gather(batch.params, np.asarray(rows), torch.tensor(rows + [0] * (-n % 4)))
        for name in FLOAT_COLUMNS + INT_COLUMNS:
            assert step.column(name).data_ptr() % 16 == 0 and step.column(name).shape == (n,)


def test_engine_samples_through_the_rows(tiny_checkpoints):
    """Requests of different parameters, arriving while others run (rows change owner): each
    seeded request writes the same tokens as when it runs alone, and each greedy one the argmax."""
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", device="cpu", max_model_len=128, block_size=8,
              max_num_seqs=3)
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + i))} for i in range(7)]
    params = [SamplingParams(temperature=[0.0, 0.8, 1.2][i % 3], top_p=[1.0, 0.9][i % 2], top_k=[-1, 20][i % 2],
                             seed=100 + i, max_tokens=6 + i, ignore_eos=True) for i in range(7)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    assert len(llm.engine.runner.batch) == 0
