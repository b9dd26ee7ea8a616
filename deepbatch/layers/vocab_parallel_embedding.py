"""Token embedding and LM head split over the vocabulary.

Over N ranks the vocabulary is padded to a multiple of N and rank r holds rows
``[r*Vp/N, (r+1)*Vp/N)`` of the ``[V, hidden]`` table (pad rows are zero)::

    embedding:  tokens outside the rank's rows look up zeros; the all-reduce fills them in
    LM head:    each rank computes logits for its rows; rank 0 gathers them and drops the pad

With one rank both are plain ``F.embedding`` / ``F.linear``. The head and the embedding shard
alike, so a tied head can use the embedding's slice as its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepbatch.distributed.parallel_state import current_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp = current_tp_group()
        self.vocab_size = vocab_size
        rows = -(-vocab_size // self.tp.world_size)
        self.vocab_start = self.tp.rank * rows
        self.vocab_end = min(self.vocab_start + rows, vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a vocabulary of "
                             f"{self.vocab_size} x {param.shape[1]}")
        mine = loaded[self.vocab_start : self.vocab_end]
        param.data[: mine.shape[0]].copy_(mine)
        param.data[mine.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 ``[S, V]`` logits of ``hidden [S, hidden]`` against this table, on rank 0;
        None on the other ranks (their slices went to rank 0)."""
        logits = F.linear(hidden, self.weight).float()
        if self.tp.is_single:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)
        return None if full is None else full[:, : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to the vocabulary (``lm_head.weight``), split like the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.compute_logits(hidden)
