"""RMSNorm, optionally fused with the residual add that precedes it. On a GPU it runs as one
Triton kernel (add + norm in one pass); elsewhere the torch reference."""

from __future__ import annotations

import torch
from torch import nn

from deepbatch.kernels.rms_norm import rms_norm, rms_norm_ref, triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if x.is_cuda and triton is not None:
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)
