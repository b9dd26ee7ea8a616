"""The one argument a model forward takes besides token ids and positions.

Tokens of all scheduled requests are packed without padding::

    input_ids:        [ r0 chunk (q0 tokens) | r1 (1 token) | r2 chunk (q2) | ... ]
    query_start_loc:  [0, q0, q0+1, q0+1+q2, ...]               (B+1 entries)
    seq_lens:         tokens in cache per request after this step (context + new)
    slot_mapping:     cache slot of every new token (-1: padding, not written)
    block_tables:     [B, max_blocks] block ids per request, 0-padded
    logits_indices:   rows whose hidden state is sampled (the last row of each request whose
                      chunk reaches its newest token)

Layers never read the per-request lengths on the host: a step's work comes from shapes and the
two host maxima, so the same forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [S] int64
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
