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

Rows outlive preemption (a preempted request keeps its row until it ends), so there can be more
live rows than ``max_num_seqs``: the pool doubles when it runs out.
"""

from __future__ import annotations

import torch


class PersistentBatch:
    def __init__(self, capacity: int, device: torch.device):
        self.device = device
        self._rows: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: row 0 first
        self.token_pool = torch.zeros(capacity, dtype=torch.long, device=device)

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

    def _grow(self) -> None:
        old = self.token_pool
        n = old.shape[0]
        self.token_pool = torch.zeros(2 * n, dtype=torch.long, device=self.device)
        self.token_pool[:n] = old
        self._free = list(range(2 * n - 1, n - 1, -1))

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Step N's sampled ids (``token_ids[i]`` is the request of row ``rows[i]``) into the pool."""
        self.token_pool[rows] = token_ids.to(torch.long)

    def read_pending(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Fill ``input_ids[positions]`` with the newest sampled ids of ``rows`` (in place)."""
        input_ids[positions] = self.token_pool[rows]
