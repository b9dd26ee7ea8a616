"""Each request's sampling parameters as one row of device tables (the persistent batch's sampling
columns), written once when the request takes its row, and a step's parameters gathered from them.

A request's temperature, top-k, top-p, min-p and seed never change, so they cross to the device
once, when the request takes its row, rather than with every batch that holds the request
(``runner/step_inputs.py`` writes the row; the first step that reads the tables copies every row
written since, so a greedy batch never sends any). A step's sampled rows are then one gather per
table on the device. A host mirror of the same columns answers what the host must know before a
launch (is every row greedy, the kernels' hints) with numpy over the step's rows.

The tables are column-major, ``[column, row]``: a gather by rows gives each column as one
contiguous vector, as the sampling kernels read them. The step pads its list of rows to a
multiple of 4, so each gathered column starts 16-byte aligned (Triton compiles a kernel once per
alignment class of its pointers: ``sampling/host_copy.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from deepbatch.kernels.sample_top_k_top_p import seed_as_int64
from deepbatch.sampling.host_copy import arrays_to_device

# Temperature and its inverse are 0 for a greedy row; top-k <= 0 or >= V is off, as is top-p >= 1
# and min-p 0; a seed is read only where ``seeded`` is 1.
FLOAT_COLUMNS = ("temperature", "inv_temperature", "top_p", "min_p")
INT_COLUMNS = ("top_k", "seed", "seeded")


def param_columns(p) -> tuple[list[float], list[int]]:
    """A ``SamplingParams``' values in the tables' columns (floats, then ints)."""
    greedy = p.greedy
    return ([0.0 if greedy else p.temperature, 0.0 if greedy else 1.0 / p.temperature, p.top_p, p.min_p],
            [p.top_k, 0 if p.seed is None else seed_as_int64(p.seed), int(p.seed is not None)])


def padded(n: int) -> int:
    """The width a step's row list is padded to (column starts 16-byte aligned)."""
    return max(4, -(-n // 4) * 4)


class SamplingParamRows:
    """The device tables and their host mirror, one row per row of the persistent batch."""

    def __init__(self, capacity: int, device: torch.device):
        self.device = device
        self.floats = torch.zeros(len(FLOAT_COLUMNS), capacity, dtype=torch.float32, device=device)
        self.ints = torch.zeros(len(INT_COLUMNS), capacity, dtype=torch.int64, device=device)
        self.host_floats = np.zeros((len(FLOAT_COLUMNS), capacity), dtype=np.float32)
        self.host_ints = np.zeros((len(INT_COLUMNS), capacity), dtype=np.int64)
        # The SamplingParams each row was last written from (held, so no id can be reused); read
        # by ``runner/step_inputs.py`` for each sampling request, so a plain list.
        self.sent: list = [None] * capacity
        self._unsent: set[int] = set()  # rows whose values the device tables do not hold yet

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` rows; the new ones are written before they are read."""
        n = self.floats.shape[1]
        self.floats = torch.cat([self.floats, self.floats.new_zeros(self.floats.shape[0], capacity - n)], 1)
        self.ints = torch.cat([self.ints, self.ints.new_zeros(self.ints.shape[0], capacity - n)], 1)
        self.host_floats = np.pad(self.host_floats, ((0, 0), (0, capacity - n)))
        self.host_ints = np.pad(self.host_ints, ((0, 0), (0, capacity - n)))
        self.sent += [None] * (capacity - n)

    def write(self, row: int, params) -> None:
        """``row`` now holds ``params``: the host mirror at once, the device tables before their
        next read (``tables``), so a batch that never reads them (greedy) sends nothing."""
        self.host_floats[:, row], self.host_ints[:, row] = param_columns(params)
        self.sent[row] = params
        self._unsent.add(row)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tables, holding every row written so far: the rows written since the last
        read cross in one copy, queued before the read (stream order)."""
        if self._unsent:
            rows = np.fromiter(self._unsent, dtype=np.int64, count=len(self._unsent))
            self._unsent.clear()
            index, floats, ints = arrays_to_device([rows, self.host_floats[:, rows], self.host_ints[:, rows]],
                                                   self.device)
            self.floats.index_copy_(1, index, floats)
            self.ints.index_copy_(1, index, ints)
        return self.floats, self.ints


class StepParams:
    """The sampling parameters of a step's rows: host columns for what the launch decides, device
    columns gathered (or copied) only when a sampling path reads them."""

    def __init__(self, host_floats: np.ndarray, host_ints: np.ndarray, device_columns):
        self.host_floats = host_floats  # [len(FLOAT_COLUMNS), S]
        self.host_ints = host_ints  # [len(INT_COLUMNS), S]
        self._device_columns = device_columns  # () -> (floats [4, padded], ints [3, padded])
        self._columns: tuple[torch.Tensor, torch.Tensor] | None = None
        self._filters = None  # (vocab, the masks of ``_filters_on``)
        greedy = host_floats[0] == 0.0
        self.all_greedy = bool(greedy.all())
        self._sampled = ~greedy

    @classmethod
    def gather(cls, table: SamplingParamRows, rows: np.ndarray, rows_device: torch.Tensor) -> StepParams:
        """Rows ``rows`` of ``table`` (``rows_device``: the same, padded to ``padded(len(rows))``)."""
        def device_columns():
            floats, ints = table.tables()
            return floats.index_select(1, rows_device), ints.index_select(1, rows_device)

        return cls(table.host_floats[:, rows], table.host_ints[:, rows], device_columns)

    @classmethod
    def of(cls, params: list, device: torch.device) -> StepParams:
        """Rows built from ``params`` (a batch outside the persistent batch: a draft model's draws,
        one row sampled alone), copied to the device in one copy when read."""
        n, width = len(params), padded(len(params))
        floats = np.zeros((len(FLOAT_COLUMNS), width), dtype=np.float32)
        ints = np.zeros((len(INT_COLUMNS), width), dtype=np.int64)
        for i, p in enumerate(params):
            floats[:, i], ints[:, i] = param_columns(p)
        return cls(floats[:, :n], ints[:, :n], lambda: tuple(arrays_to_device([floats, ints], device)))

    def _device(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._columns is None:
            self._columns = self._device_columns()
        return self._columns

    def column(self, name: str) -> torch.Tensor:
        """One column on the device, ``[S]``, contiguous."""
        n = self.host_floats.shape[1]
        floats, ints = self._device()
        if name in FLOAT_COLUMNS:
            return floats[FLOAT_COLUMNS.index(name), :n]
        return ints[INT_COLUMNS.index(name), :n]

    def _filters_on(self, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Which sampled (not greedy) rows turn on top-k, top-p, min-p, and which have a seed."""
        if self._filters is None or self._filters[0] != vocab:
            sampled, k = self._sampled, self.host_ints[0]
            self._filters = (vocab, (sampled & (k > 0) & (k < vocab), sampled & (self.host_floats[2] < 1.0),
                                     sampled & (self.host_floats[3] > 0.0), sampled & (self.host_ints[2] != 0)))
        return self._filters[1]

    def hints(self, vocab: int) -> dict:
        """The filter kernel's hints over the sampled rows (``kernels/sample_rejection.py``)."""
        top_k, top_p, min_p, _ = self._filters_on(vocab)
        return dict(max_top_k=int(self.host_ints[0][top_k].max()) if top_k.any() else 0,
                    any_top_p=bool(top_p.any()), any_min_p=bool(min_p.any()))

    def temperature_only(self, vocab: int) -> bool:
        """Every sampled row has no top-k, top-p, min-p or seed (the one-pass kernel covers it)."""
        return not any(on.any() for on in self._filters_on(vocab))

    @property
    def any_seeded(self) -> bool:
        """A row (greedy ones too) has a seed: the filter kernel reads stream positions."""
        return bool(self.host_ints[2].any())
