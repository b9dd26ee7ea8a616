"""The host side of preemption by swap: the pinned host KV pool, the block copies, and the start-up
measurements the swap cost model uses.

The host pool has the device cache's layout, block for block::

    device: layer l, tensor t: [num_gpu_blocks,  block_size, *shape]
    host:   layer l, tensor t: [num_host_blocks, block_size, *shape]   (pinned on a GPU)

so one host slot holds one block of every layer's every cache tensor (K and V for standard
attention, their per-token scales for an int8 cache, the latent vector for MLA), in each tensor's
own dtype, whatever the layers declare. On the CPU both pools are host memory; the copies run the
same code.
"""

from __future__ import annotations

import time

import torch

Caches = list[list[torch.Tensor]]


class HostKVCache:
    """Host copies of every layer's cache tensors, ``num_blocks`` blocks each.

    Contract: ``copy(device_caches, swap_out, swap_in)`` performs every ``device block -> host
    slot`` copy, then every ``host slot -> device block`` copy, before returning (swap-outs first:
    a device block freed by a swap-out may be the target of a swap-in in the same step). On a GPU
    the device-to-host copies synchronize with the kernels queued before them, so a block is read
    after the step that wrote it."""

    def __init__(self, device_caches: Caches, num_blocks: int):
        self.pin = any(t.is_cuda for layer in device_caches for t in layer)
        self.caches: Caches = [
            [torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=self.pin) for t in layer]
            for layer in device_caches
        ]
        self.num_blocks = num_blocks

    def copy(self, device_caches: Caches, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        # Blocks are gathered into a pinned staging tensor (torch's caching host allocator keeps it
        # alive until an asynchronous copy from it is done): a copy from or to pageable memory
        # would go through the driver's bounce buffer at a fraction of the link's rate.
        if swap_out:
            src, dst = _indices(swap_out, device_caches)
            for dev_layer, host_layer in zip(device_caches, self.caches):
                for d, h in zip(map(_bytes, dev_layer), map(_bytes, host_layer)):
                    staged = torch.empty((len(swap_out), *h.shape[1:]), dtype=h.dtype, pin_memory=self.pin)
                    staged.copy_(d.index_select(0, src))  # synchronous: waits for the step that wrote it
                    h.index_copy_(0, dst, staged)
        if swap_in:
            src, dst = _indices(swap_in, device_caches, to_device=True)
            for dev_layer, host_layer in zip(device_caches, self.caches):
                for d, h in zip(map(_bytes, dev_layer), map(_bytes, host_layer)):
                    staged = torch.empty((len(swap_in), *h.shape[1:]), dtype=h.dtype, pin_memory=self.pin)
                    torch.index_select(h, 0, src, out=staged)
                    d.index_copy_(0, dst, staged.to(d.device, non_blocking=self.pin))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 blocks as their bytes: the CPU has no index_copy_ for float8 types, and a block copy
    needs none of their arithmetic."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _indices(pairs: list[tuple[int, int]], device_caches: Caches, to_device: bool = False):
    device = device_caches[0][0].device
    a = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    # swap-out: (device src, host dst); swap-in: (host src, device dst)
    return (a, b.to(device)) if to_device else (a.to(device), b)


def measure_host_link_bytes_per_s(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes per second of one device->host plus host->device round trip, divided by two (the
    mean one-way rate), over a pinned buffer of ``nbytes``."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    best = float("inf")
    for _ in range(3):  # the first round warms the allocator and the DMA path; keep the best
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(dev)
        dev.copy_(host, non_blocking=pin)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / max(best, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
