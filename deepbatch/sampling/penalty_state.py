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
from deepbatch.core.draft_row import DraftRow
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
        batch, drafted = self._batch.get(requests), []
        if batch is None:
            rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
            if not rows:
                self._batch.clear()
                return logits
            slots = [self._slot(_owner(requests[i]), logits.shape[1]) for i in rows]
            values = self._to_device([[requests[i].sampling_params.repetition_penalty for i in rows],
                                      [requests[i].sampling_params.frequency_penalty for i in rows],
                                      [requests[i].sampling_params.presence_penalty for i in rows]], torch.float32)
            batch = (rows, self._to_device([rows, slots], torch.long), values)
            drafted = [(k, i, slot) for k, (i, slot) in enumerate(zip(rows, slots))
                       if isinstance(requests[i], DraftRow) and requests[i].offset]
            # A batch with draft rows is not kept: ``record`` counts only the draws each keeps.
            if any(isinstance(requests[i], DraftRow) for i in rows):
                self._batch.clear()
            else:
                self._batch.put(requests, batch)
        rows, index, values = batch
        rep, freq, pres = values
        whole = len(rows) == logits.shape[0]
        if kernel and logits.dtype == torch.float32 and logits.stride(1) == 1:
            out = torch.empty_like(logits) if whole else logits.clone()
            out = apply_penalties(logits, out, index[0], index[1], self.output_counts, self.prompt_mask,
                                  rep, freq, pres)
        else:
            sub = apply_penalties_ref(logits, index[0], index[1], self.output_counts, self.prompt_mask,
                                      rep, freq, pres)
            out = sub if whole else logits.index_copy(0, index[0], sub)
        return self._count_drafts(logits, out, requests, drafted, values) if drafted else out

    def _count_drafts(self, logits, out, requests, drafted, values) -> torch.Tensor:
        """Draft rows (``sampling/draft_rows.py``): row ``j`` of a request is drawn as if its first
        ``j`` drafts were output tokens, so at those tokens' columns its counts are the slot's plus
        how often each occurs among them. Only those columns change: they are computed again from
        the raw logits with the full counts (the formula of ``apply_penalties_ref``)."""
        entries = []
        for k, i, slot in drafted:
            d = requests[i].drafts[:requests[i].offset]
            entries += [(i, slot, t, d.count(t), k) for t in dict.fromkeys(d) if t < logits.shape[1]]
        if not entries:
            return out
        i, slot, t, extra, k = self._to_device([list(c) for c in zip(*entries)], torch.long)
        x = logits[i, t].float()
        c = self.output_counts[slot, t].float() + extra  # > 0: the token is seen
        rep, freq, pres = values[:, k]
        x = torch.where(x > 0, x / rep, x * rep)
        out[i, t] = (x - freq * c - pres).to(out.dtype)
        return out

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
            rows, slots, drafted = [], [], []
            for i, r in enumerate(requests):
                entry = self._slots.get(r.request_id)
                if entry is None or entry[1] is not _owner(r) or (skip and i in skip):
                    continue
                if isinstance(r, DraftRow):
                    drafted.append((i, entry[0], r))
                else:
                    rows.append(i), slots.append(entry[0])
            if drafted:
                self._record_kept(sampled, drafted)
            if not rows:
                return
            index = self._to_device([rows, slots], torch.long)
        tokens = sampled.to(torch.long).index_select(0, index[0])
        ones = torch.ones(len(rows), dtype=self.output_counts.dtype, device=self.device)
        self.output_counts.index_put_((index[1], tokens), ones, accumulate=True)

    def _record_kept(self, sampled: torch.Tensor, drafted: list) -> None:
        """Count the draws of draft rows that their requests keep: row ``j``'s when the draws of
        rows ``0..j-1`` equal their drafts (``sampling/draft_rows.py``), decided on the device."""
        row_at = {(r.request_id, r.offset): i for i, _, r in drafted}
        gate_entry, gate_row, gate_token = [], [], []
        for e, (_, _, r) in enumerate(drafted):
            for j in range(r.offset):
                gate_entry.append(e), gate_row.append(row_at[r.request_id, j]), gate_token.append(r.drafts[j])
        rows, slots = [i for i, _, _ in drafted], [slot for _, slot, _ in drafted]
        index = self._to_device([rows, slots], torch.long)
        tokens = sampled.to(torch.long).index_select(0, index[0])
        kept = torch.ones(len(drafted), dtype=self.output_counts.dtype, device=self.device)
        if gate_entry:
            gate = self._to_device([gate_entry, gate_row, gate_token], torch.long)
            differs = (sampled.to(torch.long).index_select(0, gate[1]) != gate[2]).to(kept.dtype)
            kept = (torch.zeros_like(kept).index_add_(0, gate[0], differs) == 0).to(kept.dtype)
        self.output_counts.index_put_((index[1], tokens), kept, accumulate=True)

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


def _owner(row) -> Request:
    """The request a sampler row belongs to (a draft row's is its request's)."""
    return row.request if isinstance(row, DraftRow) else row
