"""Copies of sampler results to the host that queue behind the kernels making them, so a step
launches them without waiting and reads them when it commits."""

from __future__ import annotations

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
