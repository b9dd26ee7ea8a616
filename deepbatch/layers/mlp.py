"""The gated MLP of Llama-family and DeepSeek dense layers (and DeepSeek's shared experts):
``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM. Under tensor parallelism
each rank holds a slice of the intermediate dim (gate|up column-parallel, down row-parallel), so
the block costs one all-reduce."""

from __future__ import annotations

import torch
from torch import nn

from deepbatch.layers.activation import silu_and_mul
from deepbatch.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, reduce_results: bool = True):
        """``reduce_results=False``: return this rank's partial sum (the caller all-reduces)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
