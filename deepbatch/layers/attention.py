"""Paged attention layer: writes this step's K/V into the cache, then attends over it.

The backend is chosen once by the runner: ``torch`` (the reference semantics, the CPU path) or
``triton`` (GPU kernels). The cache tensors are bound by the runner after it sizes the pool.
"""

from __future__ import annotations

import torch
from torch import nn

from deepbatch.kernels.paged_attention import paged_attention_torch
from deepbatch.kernels.reshape_and_cache import reshape_and_cache_ref
from deepbatch.runner.forward_batch import ForwardBatch


class AttentionBackend:
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        return paged_attention_torch(
            q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale,
            max_query_len=batch.max_query_len,
        )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        from deepbatch.kernels.paged_attention import paged_attention
        from deepbatch.kernels.reshape_and_cache import reshape_and_cache

        self._attn = paged_attention
        self._write = reshape_and_cache

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._write(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        return self._attn(
            q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale,
            batch.max_query_len, batch.max_seq_len,
        )


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return AttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend: unknown backend {name!r}")


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = AttentionBackend()

    def cache_shapes(self) -> list[tuple[int, ...]]:
        """Per-token shape of each paged cache tensor this layer needs (the runner allocates
        ``[num_blocks, block_size, *shape]`` for each). Latent-cache layers (MLA) need one."""
        return [(self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)]

    def bind(self, caches: list[torch.Tensor | None], backend: AttentionBackend) -> None:
        self.k_cache, self.v_cache = caches
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        return self.backend.attend(q, self.k_cache, self.v_cache, batch, self.scale)
