"""Paged attention layer: writes this step's K/V into the cache, then attends over it.

The backend is chosen once by the runner: ``torch`` (the reference semantics, the CPU path) or
``triton`` (GPU kernels). The cache tensors are bound by the runner after it sizes the pool; their
dtype is the cache's format (``kernels/kv_quant.py``), never the model's concern:

    auto      [K, V]                      in the model dtype
    fp8       [K, V]                      float8, with this layer's float ``k_scale``/``v_scale``
    int8      [K, V, K scales, V scales]  int8, scales [num_blocks, block_size, Hkv] float32

A layer with a ``sliding_window`` (Mistral; Qwen2's windowed layers) carries it itself and hands
it to every attend call: the runner and the forward batch stay the same for every layer, and the
window, a constant of the layer's kernel launches, never changes a shape between steps.
"""

from __future__ import annotations

import torch
from torch import nn

from deepbatch.kernels.kv_quant import FP8_DTYPES, SCALE_DTYPE, quant_mode
from deepbatch.kernels.paged_attention_torch import paged_attention_torch
from deepbatch.kernels.reshape_and_cache import reshape_and_cache_ref
from deepbatch.core.forward_batch import ForwardBatch


class AttentionBackend:
    """``k_scale``/``v_scale``: an 8-bit cache's scales (floats for fp8, the per-token tensors
    for int8), None for a cache in the model dtype."""

    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float, k_scale=None, v_scale=None,
               sliding_window: int | None = None) -> torch.Tensor:
        return paged_attention_torch(
            q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale,
            max_query_len=batch.max_query_len, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        from deepbatch.kernels.paged_attention import paged_attention
        from deepbatch.kernels.reshape_and_cache import reshape_and_cache

        self._attn = paged_attention
        self._write = reshape_and_cache

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        self._write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float, k_scale=None, v_scale=None,
               sliding_window: int | None = None) -> torch.Tensor:
        return self._attn(
            q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, scale,
            batch.max_query_len, batch.max_seq_len, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        )


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return AttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend: unknown backend {name!r}")


class PagedAttention(nn.Module):
    """``sliding_window``: a query at position ``p`` sees keys ``p - W < k <= p`` (None: all)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        self.k_scale_cache: torch.Tensor | None = None  # int8 only: [num_blocks, block_size, Hkv]
        self.v_scale_cache: torch.Tensor | None = None
        # An fp8 cache's per-layer scales (x_q = x / scale): the checkpoint's, those measured at
        # start-up (``calculate_kv_scales``), else 1.0; ``kv_scale_source`` says which.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_scale_source: str | None = None  # "checkpoint" or "calibrated"
        self.backend: AttentionBackend = AttentionBackend()

    def cache_shapes(self) -> list[tuple[int, ...]]:
        """Per-token shape of each paged cache tensor this layer needs in the model dtype (the
        runner allocates ``[num_blocks, block_size, *shape]`` for each). Latent-cache layers (MLA)
        need one."""
        return [(self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)]

    def cache_specs(self, cache_dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(per-token shape, dtype)`` of each paged tensor for K/V stored as ``cache_dtype``:
        K and V, then for int8 their per-token, per-head scales."""
        kv = [((self.num_kv_heads, self.head_dim), cache_dtype)] * 2
        if quant_mode(cache_dtype) == 2:
            kv += [((self.num_kv_heads,), SCALE_DTYPE)] * 2
        return kv

    def load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """Take a checkpoint's per-layer ``k_scale`` or ``v_scale`` (what vLLM and llm-compressor
        write for FP8 KV caches). A per-head vector is reduced to its largest entry: one scale per
        layer never clips a head that its own scale would not."""
        value = float(tensor.float().max())
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}: a KV cache scale must be finite and > 0, got {value}")
        if name.endswith("k_scale"):
            self.k_scale = value
        elif name.endswith("v_scale"):
            self.v_scale = value
        else:
            raise ValueError(f"{name}: not a k_scale or v_scale")
        self.kv_scale_source = "checkpoint"

    def bind(self, caches: list[torch.Tensor | None], backend: AttentionBackend) -> None:
        self.k_cache, self.v_cache, *scales = caches
        self.k_scale_cache, self.v_scale_cache = scales if scales else (None, None)
        self.backend = backend

    def _scales(self):
        if self.k_scale_cache is not None:
            return self.k_scale_cache, self.v_scale_cache
        if self.k_cache is not None and self.k_cache.dtype in FP8_DTYPES:
            return self.k_scale, self.v_scale
        return None, None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]
        k_scale, v_scale = self._scales()
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping, k_scale, v_scale)
        return self.backend.attend(q, self.k_cache, self.v_cache, batch, self.scale, k_scale, v_scale,
                                   sliding_window=self.sliding_window)
