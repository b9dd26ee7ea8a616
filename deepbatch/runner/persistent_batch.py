"""The runner's persistent rows: each request keeps one row from its first step until it ends,
and the row's slot in the device token pool holds the request's newest sampled id.

Under async scheduling step N+1 is built before step N's sampled ids reach the host. A request
whose newest token is still pending (``Request.num_pending_tokens``) then runs it as its next
input without the id ever leaving the device::

    step N:    sample -> token_pool[rows of the sampled requests] = sampled ids   (scatter)
    step N+1:  input_ids[pending positions] = token_pool[their requests' rows]   (gather)

Stream order puts the scatter of step N before the gather of step N+1, and the gather before any
later step's scatter, so a row freed by a finished request can go to a new one at once: the new
owner's first step is a prefill whose inputs come from the host, and its first sample rewrites the
slot. Tensor-parallel workers keep the same rows from the same step messages and fill their pool
from the ids rank 0 broadcasts, so every rank feeds a pending token from its own memory.

Each row also holds the request's block table on the device, updated by what changed since the
row's last step rather than sent whole every step (``table_updates``): a decode step appends a
block for about one request in ``block_size``, so most steps send few entries or none, and the
step's table is a gather of its rows. A row's entries past the request's blocks are zero, as a
table built on the host would be. The host tracks, per row, the ``block_ids`` list it last sent
and how far: a list that is not the same object (the request was preempted and allocated afresh,
or the row changed owner) or shorter is sent whole; one that grew sends its new entries; entries
a sliding window released (``kv_cache/manager.py``: ``NULL_BLOCK``, always a prefix) are sent as
they are released. Stream order puts step N's gather before step N+1's updates.

Each row also holds the request's sampling parameters (``sampling/param_rows.py``), written once
when the request takes the row, so a step's parameters are a gather of its sampled rows.

Rows outlive preemption (a preempted request keeps its row until it ends), so there can be more
live rows than ``max_num_seqs``: the pool doubles when it runs out.
"""

from __future__ import annotations

import torch

from deepbatch.kv_cache.manager import NULL_BLOCK
from deepbatch.sampling.param_rows import SamplingParamRows


class PersistentBatch:
    def __init__(self, capacity: int, device: torch.device, max_blocks_per_seq: int = 1):
        self.device = device
        self._rows: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: row 0 first
        self.token_pool = torch.zeros(capacity, dtype=torch.long, device=device)
        self.block_table = torch.zeros(capacity, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Per row: the block_ids list last sent, how many of its entries, how many of those are
        # released (NULL_BLOCK); entries from the second count on are zero on the device.
        self._sent: list[tuple[list[int] | None, int, int]] = [(None, 0, 0)] * capacity
        self.params = SamplingParamRows(capacity, device)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, request_id: str) -> int:
        """The request's row, given it on its first step."""
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[request_id] = self._free.pop()
        return row

    def release(self, request_id: str) -> None:
        """The request ended: its row may go to the next new request."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            _, n, _ = self._sent[row]
            self._sent[row] = (None, n, 0)  # not kept alive; the next owner's list is sent whole
            self.params.sent[row] = None  # likewise its sampling parameters

    def _grow(self) -> None:
        n = self.token_pool.shape[0]
        self.token_pool = _grown(self.token_pool, 2 * n)
        self.block_table = _grown(self.block_table, 2 * n)
        self._sent = self._sent + [(None, 0, 0)] * n
        self.params.grow(2 * n)
        self._free = list(range(2 * n - 1, n - 1, -1))

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Step N's sampled ids (``token_ids[i]`` is the request of row ``rows[i]``) into the pool."""
        self.token_pool[rows] = token_ids.to(torch.long)

    def read_pending(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Fill ``input_ids[positions]`` with the newest sampled ids of ``rows`` (in place)."""
        input_ids[positions] = self.token_pool[rows]

    # -- block tables -------------------------------------------------------------------------

    def table_updates(self, row: int, block_ids: list[int], out: tuple[list[int], list[int], list[int]]) -> None:
        """Append to ``out`` (rows, columns, values) the entries of ``row``'s device table that
        differ from ``block_ids``, and take them as sent."""
        sent, n, released = self._sent[row]
        total = len(block_ids)
        rows, columns, values = out
        if block_ids is sent and total >= n:
            start = n
            first = released  # a sliding window let blocks go: their entries turned NULL_BLOCK
            while released < n and block_ids[released] == NULL_BLOCK:
                released += 1
            if released > first:
                rows.extend([row] * (released - first))
                columns.extend(range(first, released))
                values.extend([NULL_BLOCK] * (released - first))
        else:  # a new list (a new owner, or allocated afresh) or a shorter one: sent whole
            start = released = 0
            if total < n:  # the old entries past the new end go back to zero
                rows.extend([row] * (n - total))
                columns.extend(range(total, n))
                values.extend([0] * (n - total))
        if total > self.block_table.shape[1]:
            self.block_table = _widened(self.block_table, total)
        if start < total:
            rows.extend([row] * (total - start))
            columns.extend(range(start, total))
            values.extend(block_ids[start:])
        while released < total and block_ids[released] == NULL_BLOCK:  # sent as such just now
            released += 1
        self._sent[row] = (block_ids, total, released)

    def apply_table_updates(self, rows: torch.Tensor, columns: torch.Tensor, values: torch.Tensor) -> None:
        """Write the entries ``table_updates`` listed (on the device, in stream order)."""
        self.block_table[rows, columns] = values

    def block_tables(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[len(rows), width]``: the tables of ``rows``, a step's sequences in order."""
        return self.block_table[rows, :width]


def _grown(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with ``n`` rows, the new ones zero."""
    out = torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` at least ``width`` columns wide (doubling), the new ones zero."""
    out = torch.zeros((t.shape[0], max(width, 2 * t.shape[1])), dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out
