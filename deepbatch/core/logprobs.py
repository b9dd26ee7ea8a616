"""Sampled-token logprobs kept as the sampler's per-step table, built into vLLM's shape when read.

A request that asks for ``logprobs=k`` gets, per generated token, ``{token_id: Logprob}``: the
sampled token first (with its rank), then the k most likely. Building those dicts as each step
ends costs k + 2 Python objects per request per step, on the one thread that also schedules the
next step; at a few hundred requests that is milliseconds a step. So a step keeps its logprobs as
the columns of the table the sampler copies to the host (``StepLogprobs``, one per step), a sample
keeps a reference to its row (``SampleLogprobs``), and each position's dict is built the first
time it is read: by the user of ``CompletionOutput.logprobs``, by the server's formatter, or as a
compact wire form for the engine core's output messages (``SampleLogprobs.wire``).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepbatch.core.outputs import Logprob


class StepLogprobs:
    """One step's logprobs: the sampler's host table, row ``i`` for the step's ``i``-th sampled
    request: ``[logprob of the sampled token, its rank, the k_max best logprobs, their ids]``
    (ids as floats, exact below 2**24), best first. ``counts[i]`` is how many of the best the
    row's request asked for (None: it did not ask). Nothing is converted until a row is read."""

    __slots__ = ("_table", "_k", "_token_ids", "counts")

    def __init__(self, table, k: int, token_ids: list[int], counts: list[int | None]):
        """``table``: a numpy array of ``len(counts)`` rows and ``2 + 2 * k`` columns."""
        self._table, self._k = table, k
        self._token_ids, self.counts = token_ids, counts

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, row: int) -> dict[int, Logprob] | None:
        """Row ``row`` in vLLM's shape (None for a row that did not ask)."""
        return None if self.counts[row] is None else self.entry(row)

    def _entries(self, row: int) -> list[tuple[int, float, int]]:
        """``(token, logprob, rank)`` of the row: the sampled token, then the best it asked for."""
        values = self._table[row].tolist()  # one conversion of the row
        k, sampled = self._k, self._token_ids[row]
        entries = [(sampled, values[0], int(values[1]))]
        for j in range(self.counts[row]):
            t = int(values[2 + k + j])
            if t != sampled:  # the top ids are distinct: only the sampled one can repeat
                entries.append((t, values[2 + j], j + 1))
        return entries

    def entry(self, row: int) -> dict[int, Logprob]:
        return {t: Logprob(lp, rank) for t, lp, rank in self._entries(row)}

    def wire(self, row: int) -> dict[int, tuple[float, int]]:
        """``entry(row)`` as ``{token_id: (logprob, rank)}``: no ``Logprob`` objects."""
        return {t: (lp, rank) for t, lp, rank in self._entries(row)}


class SampleLogprobs(Sequence):
    """One sample's per-token logprobs: a sequence of ``{token_id: Logprob}`` (vLLM's
    ``CompletionOutput.logprobs``; indexing, slicing, iteration and ``==`` with a list work as on
    a list). Positions are rows of step tables until first read, then their dicts.

    A position costs two list slots (its step, its row) and no object of its own: a request with
    logprobs adds one position per step, and a tuple per position would be one more object for
    the garbage collector to walk, for every token of every running request."""

    __slots__ = ("_steps", "_rows", "_built")

    def __init__(self) -> None:
        self._steps: list[StepLogprobs | None] = []  # None: appended as a built dict
        self._rows: list[int] = []
        self._built: dict[int, dict[int, Logprob]] = {}  # position -> its dict, once built

    def append(self, entry: dict[int, Logprob]) -> None:
        self._built[len(self._steps)] = entry
        self._steps.append(None)
        self._rows.append(-1)

    def append_row(self, step: StepLogprobs, row: int) -> None:
        self._steps.append(step)
        self._rows.append(row)

    def copy(self) -> SampleLogprobs:
        """A snapshot: later appends to this one do not show in it (rows are shared, not built)."""
        out = SampleLogprobs()
        out._steps, out._rows, out._built = self._steps[:], self._rows[:], dict(self._built)
        return out

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._steps)))]
        position = range(len(self._steps))[index]  # negative indices, and IndexError past the end
        entry = self._built.get(position)
        if entry is None:
            entry = self._built[position] = self._steps[position].entry(self._rows[position])
        return entry

    def __iter__(self):
        for i in range(len(self._steps)):
            yield self[i]

    def wire(self, start: int) -> list[dict[int, tuple[float, int]]]:
        """Positions ``start:`` as ``{token_id: (logprob, rank)}`` (the engine core's messages)."""
        out = []
        for position in range(start, len(self._steps)):
            entry = self._built.get(position)
            if entry is None:
                out.append(self._steps[position].wire(self._rows[position]))
            else:
                out.append({t: (lp.logprob, lp.rank) for t, lp in entry.items()})
        return out

    def __eq__(self, other) -> bool:
        if isinstance(other, (SampleLogprobs, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"SampleLogprobs({list(self)!r})"
