"""Copies of sampler results to the host that queue behind the kernels making them, so a step
launches them without waiting and reads them when it commits."""

from __future__ import annotations

import numpy as np
import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s copy on the host, queued behind the kernels that make it (pinned on a GPU)."""
    return copy_to_host(t, t.device.type == "cuda")


def copy_to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """With ``pin``, a non-blocking copy into pinned memory: valid once the stream reaches it."""
    if not pin:
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def table_to_device(rows: list[list], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``rows`` (equal lengths) as a ``[len(rows), n]`` tensor on ``device``, copied from pinned
    memory on a GPU so the copy queues behind the step's kernels instead of waiting for them.

    Each row starts 16-byte aligned (the width is padded to a multiple of 4 elements, then sliced
    off): the rows go to Triton kernels, and Triton compiles a kernel once per alignment class of
    its pointer arguments, so rows at offsets that follow the batch size would compile new variants
    in the middle of serving, a second or more each."""
    n = len(rows[0]) if rows else 0
    width = max(4, -(-n // 4) * 4)
    padded = [list(r) + [0] * (width - n) for r in rows]
    t = torch.tensor(padded, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)[:, :n]


def arrays_to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Each array as a tensor on ``device`` (same dtype and shape), all through one staging buffer
    and one copy: pinned on a GPU, so the copy queues behind the step's kernels instead of waiting
    for them. A step's inputs cross together: one pinned allocation and one copy cost the host
    far less than one of each per array. Each tensor starts 16-byte aligned (Triton compiles a
    kernel per alignment class of its pointers, ``table_to_device``)."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16
    host = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = host.numpy()
    for a, off in zip(arrays, offsets):
        staging[off : off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
    dev = host.to(device, non_blocking=True)
    return [dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype.type]).view(a.shape)
            for a, off in zip(arrays, offsets)]


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32, np.bool_: torch.bool}
