"""The GPU allocator view computed from crafted ``memory_stats`` / ``memory_snapshot`` data."""

from __future__ import annotations

import pytest
import torch

from deepbatch.metrics.allocator import allocator_view, gpu_allocator_view

MiB = 1 << 20


def segment(device, blocks):
    return {"device": device, "address": 0, "total_size": sum(s for s, _ in blocks), "segment_type": "large",
            "blocks": [{"size": s, "state": state} for s, state in blocks]}


SNAPSHOT = [
    segment(0, [(8 * MiB, "active_allocated"), (2 * MiB, "inactive"), (6 * MiB, "active_allocated")]),
    segment(0, [(20 * MiB, "inactive"), (4 * MiB, "active_pending_free"), (24 * MiB, "active_allocated")]),
    segment(1, [(64 * MiB, "inactive")]),  # another GPU's segment
]
STATS = {"reserved_bytes.all.current": 64 * MiB, "allocated_bytes.all.current": 38 * MiB}


def test_reserved_allocated_largest_free_and_fragmentation():
    v = allocator_view(STATS, SNAPSHOT, device=0)
    assert (v.reserved_bytes, v.allocated_bytes) == (64 * MiB, 38 * MiB)
    # A block pending free is not yet reusable; the other device's free segment is not ours.
    assert v.largest_free_segment_bytes == 20 * MiB
    assert v.num_segments == 2
    assert v.fragmentation_ratio == pytest.approx(1 - 38 / 64)


def test_the_dict_form_of_the_snapshot_and_all_devices():
    v = allocator_view(STATS, {"segments": SNAPSHOT})
    assert v.largest_free_segment_bytes == 64 * MiB and v.num_segments == 3


def test_nothing_reserved_is_no_fragmentation():
    v = allocator_view({}, [])
    assert (v.reserved_bytes, v.allocated_bytes, v.largest_free_segment_bytes, v.fragmentation_ratio) == (0, 0, 0, 0.0)
    assert v.as_dict()["fragmentation_ratio"] == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_no_view_without_cuda():
    assert gpu_allocator_view() is None
