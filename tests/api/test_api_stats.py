"""``GET /stats`` and the swap / preemption / allocator metrics, in process over a fake engine."""

from __future__ import annotations

from dataclasses import replace

from fastapi.testclient import TestClient

from apitest_fakes import FakeEngine
from apitest_server import parse_metrics
from deepbatch.api.metrics import ServerMetrics
from deepbatch.api.server import ServerConfig, build_app
from deepbatch.engine.async_engine import AsyncEngine
from deepbatch.metrics.allocator import AllocatorView


def test_stats_route_on_the_cpu():
    engine = AsyncEngine(FakeEngine())
    with TestClient(build_app(engine, ServerConfig(log_stats_interval=0))) as client:
        stats = client.get("/stats").json()
        text = client.get("/metrics").text
    assert stats["num_preemptions"] == {"total": 0, "swap": 0, "recompute": 0}
    assert stats["kv_cache"]["num_blocks"] == 100 and stats["kv_cache"]["internal_fragmentation"] == 0.0
    assert stats["swap_space"] == {"blocks_total": 0, "free_blocks": 0} and stats["num_requests_swapped"] == 0
    assert stats["gpu_allocator"] is None  # no CUDA in this process
    metrics = parse_metrics(text)
    assert metrics['deepbatch:num_preemptions_total{mode="swap",model_name="fake"}'] == 0
    assert "deepbatch:gpu_memory_reserved_bytes" not in text and "deepbatch:swap_space_blocks_total" not in text


class _Snapshots:
    def __init__(self, snap):
        self.snap = snap

    def snapshot(self):
        return self.snap

    def add_observer(self, observer):
        pass


def test_preemptions_by_mode_swap_space_and_allocator_gauges():
    engine = AsyncEngine(FakeEngine())
    engine._publish_snapshot()
    alloc = AllocatorView(reserved_bytes=64, allocated_bytes=48, largest_free_segment_bytes=8, num_segments=2,
                          fragmentation_ratio=0.25)
    snap = replace(engine.snapshot(), num_preemptions=5, num_preemptions_swap=3, num_preemptions_recompute=2,
                   num_swapped=1, swap_blocks_total=10, swap_free_blocks=4, allocator=alloc)
    m = parse_metrics(ServerMetrics(_Snapshots(snap), "m").render().decode())
    assert m['vllm:num_preemptions_total{model_name="m"}'] == 5
    assert m['deepbatch:num_preemptions_total{mode="swap",model_name="m"}'] == 3
    assert m['deepbatch:num_preemptions_total{mode="recompute",model_name="m"}'] == 2
    assert m['deepbatch:swap_space_free_blocks{model_name="m"}'] == 4
    assert m['vllm:num_requests_swapped{model_name="m"}'] == 1
    assert m['deepbatch:gpu_memory_reserved_bytes{model_name="m"}'] == 64
    assert m['deepbatch:gpu_memory_allocated_bytes{model_name="m"}'] == 48
    assert m['deepbatch:gpu_memory_largest_free_segment_bytes{model_name="m"}'] == 8
    assert m['deepbatch:gpu_memory_fragmentation_ratio{model_name="m"}'] == 0.25
