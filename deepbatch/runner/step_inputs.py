"""A scheduled step's model inputs (``ForwardBatch``) from its requests: token ids, positions, KV
slots, query and sequence lengths, block tables and the rows whose logits are read (each
sampling request's newest position, then its drafts' positions, ``sampling/draft_rows.py``).

A decode (one token) and a short chunk (a request's newest token and its drafts, up to
``SHORT_CHUNK`` tokens) are built as plain ints appended to flat lists, each turned into one array
at the end; a longer chunk (a prefill chunk) computes its positions and slots in numpy, as a piece
between the flat runs before and after it. The arrays cross to the device together, in one copy
(``sampling/host_copy.py``). Block tables and sampling parameters stay on the device in the
persistent batch, which is sent only what changed (``runner/persistent_batch.py``); the step
names the persistent rows of its logits rows (``StepInputs.sample_rows``), from which the sampler
gathers its parameters and into which the sampled ids go.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from deepbatch.core.forward_batch import ForwardBatch
from deepbatch.core.scheduler_output import SchedulerOutput
from deepbatch.runner.persistent_batch import PersistentBatch
from deepbatch.sampling.host_copy import arrays_to_device
from deepbatch.sampling.param_rows import padded
from deepbatch.sampling.prompt_logprobs import PromptLogprobRows, prompt_logprob_rows


# Chunks up to this many tokens (a request's newest token and its drafts) skip numpy, whose calls
# cost more than a few Python ints (and whose block-table copy grows with the context).
SHORT_CHUNK = 17


class StepInputs(NamedTuple):
    batch: ForwardBatch
    prompt_rows: list[PromptLogprobRows]  # the rows whose logits give prompt logprobs (usually none)
    # Per logits row (each sampling request's newest position, then the draft positions), the
    # persistent row of its request: on the host, and on the device padded to a multiple of 4
    # (``sampling/param_rows.py``).
    sample_rows: np.ndarray
    sample_rows_device: torch.Tensor


def step_inputs(out: SchedulerOutput, bs: int, pool: PersistentBatch, device: torch.device) -> StepInputs:
    """The step's inputs (``bs``: the block size) on ``device``. A decode whose input token is
    still pending reads it from the request's row of the token pool (``pool``)."""
    ids, positions, slots, qsl, seq_lens, logits_idx, spec_idx = [], [], [], [0], [], [], []
    pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (positions, slots) of long chunks and the runs before them
    pending_rows, pending_src = [], []
    prompt_rows: list[PromptLogprobRows] = []
    seq_rows: list[int] = []  # each request's row of the persistent batch
    sample_rows: list[int] = []  # each sampling request's row, then each draft position's
    draft_rows: list[int] = []
    table_updates: tuple[list[int], list[int], list[int]] = ([], [], [])
    params_sent, new_params = pool.params.sent, []
    max_blocks = 1
    for s in out.scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        row = pool.row(r.request_id)
        seq_rows.append(row)
        pool.table_updates(row, r.block_ids, table_updates)
        if s.num_new_tokens == 1:  # decode: plain ints, no per-row array work
            if start < len(r.all_token_ids):
                ids.append(r.all_token_ids[start])
            else:  # sampled by the step still in flight: its id is in the token pool
                ids.append(0)
                pending_rows.append(qsl[-1])
                pending_src.append(row)
            positions.append(start)
            slots.append(r.block_ids[start // bs] * bs + start % bs)
            # A one-token chunk short of the newest token (a decode always reaches it) may
            # be a prompt position.
            if not s.samples and (lp_rows := prompt_logprob_rows(r, start, end, qsl[-1])):
                prompt_rows.append(lp_rows)
        else:
            known = end - s.num_spec_tokens
            if known > len(r.all_token_ids):  # only a decode's one token can be pending
                raise RuntimeError(f"request {r.request_id}: a chunk of {s.num_new_tokens} tokens ends at a "
                                   "pending token")
            ids += r.all_token_ids[start:known]
            if s.num_spec_tokens:  # the drafts; their rows are sampled after the others
                ids += r.spec_token_ids[:s.num_spec_tokens]
                spec_idx.extend(range(qsl[-1] + known - start - 1, qsl[-1] + s.num_new_tokens - 1))
            if s.num_new_tokens <= SHORT_CHUNK:  # a verification step's few tokens: plain ints
                blocks = r.block_ids
                positions.extend(range(start, end))
                slots.extend([blocks[p // bs] * bs + p % bs for p in range(start, end)])
            else:
                if positions:  # the flat run before this chunk
                    pieces.append((np.asarray(positions, dtype=np.int64), np.asarray(slots, dtype=np.int64)))
                    positions, slots = [], []
                pos = np.arange(start, end)
                table = np.asarray(r.block_ids, dtype=np.int64)
                pieces.append((pos, table[pos // bs] * bs + pos % bs))
            if lp_rows := prompt_logprob_rows(r, start, end, qsl[-1]):
                prompt_rows.append(lp_rows)
        qsl.append(qsl[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if s.samples:
            logits_idx.append(qsl[-1] - 1)
            sample_rows.append(row)
            if s.num_spec_tokens:
                draft_rows.extend([row] * s.num_spec_tokens)
            # A tensor-parallel worker's mirror has no parameters (None): its rows are never written.
            if params_sent[row] is not r.sampling_params:
                new_params.append((row, r.sampling_params))
        max_blocks = max(max_blocks, len(r.block_ids))
    q_lens = [s.num_new_tokens for s in out.scheduled]
    num_seqs, num_sampled = len(seq_rows), len(sample_rows) + len(draft_rows)
    # Rows padded to a multiple of 4 (``sampling/param_rows.py``); when every request samples and
    # none drafts (most steps), the sampled rows are the step's rows and cross once.
    shared = len(sample_rows) == num_seqs and not draft_rows
    if shared:
        seq_rows += [0] * (padded(num_sampled) - num_sampled)
    else:
        sample_rows += draft_rows + [0] * (padded(num_sampled) - num_sampled)
    if pieces:
        if positions:
            pieces.append((np.asarray(positions, dtype=np.int64), np.asarray(slots, dtype=np.int64)))
        positions_np, slots_np = (np.concatenate(c) for c in zip(*pieces))
    else:
        positions_np, slots_np = np.asarray(positions, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    seq_rows_np = np.asarray(seq_rows, dtype=np.int64)
    sample_rows_np = seq_rows_np if shared else np.asarray(sample_rows, dtype=np.int64)
    arrays = [np.asarray(ids, dtype=np.int64), positions_np, slots_np,
              np.asarray(qsl, dtype=np.int32), np.asarray(seq_lens, dtype=np.int32),
              np.asarray(logits_idx + spec_idx, dtype=np.int64), seq_rows_np]
    # The rest cross only when there is something to send (most steps send none of them).
    if not shared:
        arrays.append(sample_rows_np)
    if pending_rows:
        arrays.append(np.asarray(pending_rows + pending_src, dtype=np.int64))
    if table_updates[0]:
        arrays += [np.asarray(table_updates[:2], dtype=np.int64), np.asarray(table_updates[2], dtype=np.int32)]
    for row, params in new_params:  # requests new to their rows (host only: ``sampling/param_rows.py``)
        pool.params.write(row, params)
    on_device = iter(arrays_to_device(arrays, device))
    input_ids, positions_d, slots_d, qsl_d, seq_lens_d, logits_d, rows_d = (next(on_device) for _ in range(7))
    sample_rows_d = rows_d if shared else next(on_device)
    if pending_rows:
        # Stream order makes this read the previous step's sampled ids once they exist.
        where, n = next(on_device), len(pending_rows)
        pool.read_pending(input_ids, where[:n], where[n:])
    if table_updates[0]:  # the blocks that changed since each row's last step, then the step's rows
        table_at, table_values = next(on_device), next(on_device)
        pool.apply_table_updates(table_at[0], table_at[1], table_values)
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=positions_d,
        slot_mapping=slots_d,
        query_start_loc=qsl_d,
        seq_lens=seq_lens_d,
        block_tables=pool.block_tables(rows_d[:num_seqs], max_blocks),
        logits_indices=logits_d,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return StepInputs(batch, prompt_rows, sample_rows_np[:num_sampled], sample_rows_d)
