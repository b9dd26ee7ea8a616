"""Linear layers that know how to load their checkpoint tensors.

``MergedLinear`` stacks several checkpoint projections along the output dim (q|k|v, gate|up) so a
layer runs one GEMM instead of several; each checkpoint tensor is copied into its slice by
``weight_loader(param, tensor, shard)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} for a parameter of {tuple(param.shape)}")
        param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input, concatenated along the output dim."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:
            return super().weight_loader(param, loaded)
        off, size = self.offsets[shard], self.out_sizes[shard]
        dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint shard {shard} of shape {tuple(loaded.shape)} for a slice of {tuple(dst.shape)}")
        dst.copy_(loaded)
