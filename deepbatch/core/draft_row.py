"""A request seen some tokens past its newest one: a row of a speculative-decoding step
(``sampling/draft_rows.py``), read by the sampler, the penalties and the grammar bitmask as they
read the request itself."""

from __future__ import annotations

from deepbatch.core.request import Request


class DraftRow:
    """A request as seen ``offset`` tokens past its newest one, the first ``offset`` of this
    step's ``drafts`` taken: what the sampler reads of it, with ``num_output_tokens`` moved on by
    ``offset``. The penalties add the drafts before it to the request's counts
    (``sampling/penalty_state.py``); the grammar's matcher walks them
    (``structured_output/bitmask.py``)."""

    # What the sampler reads of every row, copied as the row is made (for the step it serves):
    # ``__getattr__`` would find them too, at a cost paid per row per step.
    __slots__ = ("request", "offset", "drafts", "sampling_params", "structured_output")

    def __init__(self, request: Request, offset: int, drafts: list[int]):
        self.request = request
        self.offset = offset
        self.drafts = drafts
        self.sampling_params = request.sampling_params
        self.structured_output = request.structured_output

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.offset

    def __getattr__(self, name):
        return getattr(self.request, name)
