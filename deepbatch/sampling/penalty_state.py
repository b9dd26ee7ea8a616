"""Repetition, frequency and presence penalties from per-request state kept on the device.

Each request that samples with penalties owns a slot, one row of two persistent tensors:
``output_counts[slot, t]`` (how often the request has sampled token ``t``) and
``prompt_mask[slot, t]`` (``t`` is in its prompt). A slot is filled once, from the host, the
first time its request is sampled; after that each step adds its sampled ids to the counts with
one device op queued right behind the sampling. So no step copies a request's history to the
device, and a step launched while the previous one's tokens are still pending (async scheduling)
reads counts that already hold them: stream order, not the host, makes them wait.

The counts are exact because every token a request samples becomes one of its output tokens
unless the request ends first (its sampling failed, or it finished while the next step was in
flight, whose token is then dropped); an ended request's slot is freed by ``forget``. Preemption
by recompute keeps a request's output tokens, so it keeps its counts.

The rows grow by doubling up to ``reserved_rows`` (the runner sizes the KV cache with that many
rows set aside: ``max_num_seqs``), then by a quarter, since preempted requests keep their slots
and may outnumber the running ones; an engine whose requests never use penalties allocates
nothing (and reserves ``reserved_rows * bytes_per_row(V)``, about 5 bytes per vocabulary entry).
"""

from __future__ import annotations

import torch

from deepbatch.core.request import Request
from deepbatch.kernels.apply_penalties import apply_penalties, apply_penalties_ref
from deepbatch.sampling.batch_memo import BatchMemo
from deepbatch.sampling.host_copy import table_to_device


def bytes_per_row(vocab: int) -> int:
    """One request's state: int32 counts and a bool prompt mask over the vocabulary."""
    return vocab * (torch.int32.itemsize + torch.bool.itemsize)


class PenaltyState:
    def __init__(self, device: str | torch.device, reserved_rows: int = 256):
        self.device = torch.device(device)
        self.reserved_rows = reserved_rows
        self.output_counts: torch.Tensor | None = None  # [rows, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] bool
        # request id -> (slot, the request): a slot is only valid for the request that filled it.
        self._slots: dict[str, tuple[int, Request]] = {}
        self._free: list[int] = []
        # The last batch ``apply`` saw: its rows, their slots, both on the device (``[2, P]``: rows,
        # then slots; ``record`` reuses it for the same batch) and the penalty values.
        self._batch = BatchMemo()

    @property
    def num_rows(self) -> int:
        return 0 if self.output_counts is None else self.output_counts.shape[0]

    @property
    def num_slots_used(self) -> int:
        return len(self._slots)

    def slot_of(self, request_id: str) -> int | None:
        entry = self._slots.get(request_id)
        return None if entry is None else entry[0]

    # -- the step --------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, requests: list[Request], kernel: bool = False) -> torch.Tensor:
        """``logits`` (row ``i`` is ``requests[i]``'s) with the penalties applied to the rows
        that ask for them, as a new tensor (the raw logits stay as they were: a batch whose
        sampling fails is sampled again row by row from them). Fills the slots of requests seen
        for the first time. ``kernel``: one Triton pass (``kernels/apply_penalties.py``) instead
        of the torch ops."""
        batch = self._batch.get(requests)
        if batch is None:
            rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
            if not rows:
                self._batch.clear()
                return logits
            slots = [self._slot(requests[i], logits.shape[1]) for i in rows]
            values = self._to_device([[requests[i].sampling_params.repetition_penalty for i in rows],
                                      [requests[i].sampling_params.frequency_penalty for i in rows],
                                      [requests[i].sampling_params.presence_penalty for i in rows]], torch.float32)
            batch = self._batch.put(requests, (rows, self._to_device([rows, slots], torch.long), values))
        rows, index, values = batch
        rep, freq, pres = values
        whole = len(rows) == logits.shape[0]
        if kernel and logits.dtype == torch.float32 and logits.stride(1) == 1:
            out = torch.empty_like(logits) if whole else logits.clone()
            return apply_penalties(logits, out, index[0], index[1], self.output_counts, self.prompt_mask,
                                   rep, freq, pres)
        sub = apply_penalties_ref(logits, index[0], index[1], self.output_counts, self.prompt_mask, rep, freq, pres)
        return sub if whole else logits.index_copy(0, index[0], sub)

    def record(self, sampled: torch.Tensor, requests: list[Request], skip: set[int] | dict | None = None) -> None:
        """Count the step's sampled ids (``sampled[i]`` is ``requests[i]``'s), once per step and
        after the step's final ids are known; rows in ``skip`` (failed, so their requests end)
        and requests without a filled slot are left out."""
        if not self._slots:  # no penalised request alive: nothing to count (the common step)
            return
        batch = None if skip else self._batch.get(requests)
        if batch is not None:
            rows, index, _ = batch  # the batch ``apply`` filled: every row has its slot
        else:
            rows, slots = [], []
            for i, r in enumerate(requests):
                entry = self._slots.get(r.request_id)
                if entry is not None and entry[1] is r and not (skip and i in skip):
                    rows.append(i), slots.append(entry[0])
            if not rows:
                return
            index = self._to_device([rows, slots], torch.long)
        tokens = sampled.to(torch.long).index_select(0, index[0])
        ones = torch.ones(len(rows), dtype=self.output_counts.dtype, device=self.device)
        self.output_counts.index_put_((index[1], tokens), ones, accumulate=True)

    def forget(self, request_id: str) -> None:
        """The request ended: its slot may be handed to another. Work already queued on its
        row (the update of a step in flight) runs before the new owner's fill, in stream order."""
        entry = self._slots.pop(request_id, None)
        if entry is not None:
            self._free.append(entry[0])
            self._batch.clear()  # its slot may go to another request: the next batch is looked up

    # -- slots -----------------------------------------------------------------------------

    def _slot(self, r: Request, vocab: int) -> int:
        entry = self._slots.get(r.request_id)
        if entry is not None and entry[1] is r:
            return entry[0]
        if self.output_counts is not None and self.output_counts.shape[1] != vocab:
            raise ValueError(f"logits of width {vocab} after {self.output_counts.shape[1]}")
        if r.num_pending_tokens:
            # A pending token means an earlier sample, which filled the slot that lives as long
            # as the request; its id is not on the host to fill from.
            raise RuntimeError(f"request {r.request_id}: no penalty state for a request already sampled")
        if entry is not None:  # the id of a request that ended without being forgotten
            slot = entry[0]
        else:
            slot = self._free.pop() if self._free else self._grow(vocab)
        prompt = self._to_device([r.prompt_token_ids], torch.long)[0]
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, prompt] = True
        self.output_counts[slot] = 0
        if r.output_token_ids:  # first sampled after its outputs began (they are all known)
            out = self._to_device([r.output_token_ids], torch.long)[0]
            self.output_counts[slot].index_add_(0, out, torch.ones_like(out, dtype=self.output_counts.dtype))
        # Registered only once filled: a fill that raises is tried again (row by row) next time.
        self._slots[r.request_id] = (slot, r)
        return slot

    def _grow(self, vocab: int) -> int:
        """A free slot, growing the rows when all are taken (module docstring)."""
        old = self.num_rows
        new = max(1, min(2 * old, self.reserved_rows)) if old < self.reserved_rows else old + max(1, old // 4)
        counts = torch.zeros(new, vocab, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, vocab, dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self.output_counts
            mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self._free.extend(range(new - 1, old, -1))  # popped lowest first
        return old

    # -- host -> device --------------------------------------------------------------------

    def _to_device(self, rows: list[list], dtype: torch.dtype) -> torch.Tensor:
        return table_to_device(rows, dtype, self.device)
