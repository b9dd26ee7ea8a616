"""The GPU caching allocator's view of device memory: what torch holds vs what tensors use.

torch keeps freed device memory in reserved segments for reuse. Memory reserved but not
allocated is lost to everyone else; when it is split into many small free blocks, a large
allocation can still fail (or trigger a cudaMalloc retry) although the total free is enough::

    reserved segment:  [ used | free 2 MiB | used | free 30 MiB        | used ]
                                                    ^ largest free segment

``fragmentation_ratio = 1 - allocated / reserved``: 0 when everything torch holds is in use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class AllocatorView:
    reserved_bytes: int
    allocated_bytes: int
    largest_free_segment_bytes: int  # the largest free block inside reserved segments
    num_segments: int
    fragmentation_ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


def allocator_view(memory_stats: dict, snapshot: list[dict] | dict, device: int | None = None) -> AllocatorView:
    """The view from ``torch.cuda.memory_stats()`` and ``torch.cuda.memory_snapshot()`` (a list of
    segments, each with ``blocks`` of a ``size`` and a ``state``; a dict with ``segments`` is also
    accepted). Segments of other devices are skipped when ``device`` is given."""
    segments = snapshot.get("segments", []) if isinstance(snapshot, dict) else snapshot
    if device is not None:
        segments = [s for s in segments if s.get("device", device) == device]
    largest = max((b["size"] for s in segments for b in s.get("blocks", ()) if b.get("state") == "inactive"),
                  default=0)
    reserved = int(memory_stats.get("reserved_bytes.all.current", 0))
    allocated = int(memory_stats.get("allocated_bytes.all.current", 0))
    return AllocatorView(
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        largest_free_segment_bytes=int(largest),
        num_segments=len(segments),
        fragmentation_ratio=1.0 - allocated / reserved if reserved else 0.0,
    )


def gpu_allocator_view(device: int | None = None) -> AllocatorView | None:
    """This process's allocator view of one GPU (the current one by default); None when CUDA is
    unavailable or this process has not used it."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device() if device is None else device
    return allocator_view(torch.cuda.memory_stats(index), torch.cuda.memory_snapshot(), index)
