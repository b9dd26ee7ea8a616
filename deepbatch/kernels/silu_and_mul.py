"""The gated MLP's activation over a fused ``[gate | up]`` projection: ``silu(gate) * up``.

``x`` is ``[..., 2I]``; the result is ``[..., I]`` in ``x``'s dtype. As in PyTorch, ``silu`` runs in
float32 and is rounded to the input dtype before the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepbatch.kernels.common import jit as _jit, tl, triton

def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref`."""
    if triton is None:
        raise RuntimeError("silu_and_mul: Triton is not installed; use silu_and_mul_ref")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"silu_and_mul: x must be a float tensor [..., 2I] of {_DTYPES}, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension must be even ([gate | up]), got {x.shape[-1]}")
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x needs a contiguous last dimension, strides {x.stride()}")
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, 2 * inter)
    out2 = out.view(-1, inter)
    if x2.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out2, inter, x2.stride(0), out2.stride(0), BLOCK=block, num_warps=4,
        )
    return out
