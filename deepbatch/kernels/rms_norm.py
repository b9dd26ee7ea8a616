"""RMSNorm over the last dimension, optionally fused with the residual add before it.

Matches HF Llama's RMSNorm bit for bit in structure: the sum ``x + residual`` is rounded to the
input dtype (it is the next residual), the normalisation runs in float32, is cast back to the input
dtype, and only then multiplied by ``weight``::

    new_residual = x + residual                      (input dtype)
    out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype),   h = new_residual.float()
"""

from __future__ import annotations

import torch
from deepbatch.kernels.common import jit as _jit, tl, triton

def rms_norm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``out``, or ``(out, new_residual)`` when ``residual`` is given."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


@_jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, eps, stride_x, stride_r, stride_o, stride_ro,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = (h * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 65536  # one row per program, held in registers


def _as_rows(name: str, t: torch.Tensor, hidden: int) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"rms_norm: {name} needs a contiguous last dimension, strides {t.stride()}")
    # 2-D views keep their row stride (a slice of a wider projection); other ranks are flattened.
    return t if t.dim() == 2 else t.reshape(-1, hidden)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rms_norm_ref`; returns new tensors (inputs are not modified)."""
    if triton is None:
        raise RuntimeError("rms_norm: Triton is not installed; use rms_norm_ref")
    if x.dim() < 1 or x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x must be a float tensor [..., H] of {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: weight must be a float [{hidden}], got {weight.dtype} {tuple(weight.shape)}")
    if hidden == 0 or hidden > _MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {hidden} outside [1, {_MAX_HIDDEN}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {residual.dtype} {tuple(residual.shape)} must match x "
                         f"{x.dtype} {tuple(x.shape)}")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"rms_norm: {name} is on {t.device}, x on {x.device}")
    if weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be contiguous, stride {weight.stride()}")

    x2 = _as_rows("x", x, hidden)
    r2 = _as_rows("residual", residual, hidden) if residual is not None else x2
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    out2, nr2 = out.view(-1, hidden), new_residual.view(-1, hidden)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, nr2, hidden, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0),
            BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out if residual is None else (out, new_residual)
