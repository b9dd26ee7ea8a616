"""The gated MLP's activation: ``silu(gate) * up`` over a fused ``[gate | up]`` projection."""

from __future__ import annotations

import torch

from deepbatch.kernels.silu_and_mul import silu_and_mul as silu_and_mul_triton
from deepbatch.kernels.silu_and_mul import silu_and_mul_ref, triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and triton is not None:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
