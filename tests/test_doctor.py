"""``deepbatch doctor``'s memory readers and the swap-space check, on crafted cgroup v1/v2
directories and a crafted /proc/meminfo."""

from __future__ import annotations

import pytest

from deepbatch.kv_cache.host_memory import cgroup_memory, check_swap_space, host_memory

GiB = 1 << 30


def cgroup_v2(root, limit: str, usage: int):
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{usage}\n")
    return str(root)


def cgroup_v1(root, limit: int, usage: int):
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{usage}\n")
    return str(root)


def test_cgroup_v2_and_v1_are_read(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    assert cgroup_memory(cgroup_v2(tmp_path / "a", str(8 * GiB), GiB)) == {"version": 2, "limit_bytes": 8 * GiB, "usage_bytes": GiB}
    assert cgroup_memory(cgroup_v2(tmp_path / "b", "max", GiB))["limit_bytes"] is None
    v1 = cgroup_memory(cgroup_v1(tmp_path / "c", 4 * GiB, GiB))
    assert v1 == {"version": 1, "limit_bytes": 4 * GiB, "usage_bytes": GiB}
    assert cgroup_memory(str(tmp_path / "none"))["version"] is None


def test_host_memory_from_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\n")
    assert host_memory(str(tmp_path / "meminfo")) == {"total_bytes": 16384 * 1024, "available_bytes": 8192 * 1024}


@pytest.mark.parametrize("version", [1, 2])
def test_swap_space_over_the_cgroup_headroom_is_refused(tmp_path, version):
    root = cgroup_v2(tmp_path, str(8 * GiB), 5 * GiB) if version == 2 else cgroup_v1(tmp_path, 8 * GiB, 5 * GiB)
    cg, host = cgroup_memory(root), {"available_bytes": 100 * GiB}
    check_swap_space(2 * GiB, cg, host)  # 3 GiB left under the limit
    with pytest.raises(ValueError, match=f"cgroup v{version} memory limit .*3.00 GiB left"):
        check_swap_space(4 * GiB, cg, host)


def test_swap_space_over_available_host_memory_is_refused():
    unlimited = {"version": 2, "limit_bytes": None, "usage_bytes": GiB}
    check_swap_space(GiB, unlimited, {"available_bytes": 2 * GiB})
    with pytest.raises(ValueError, match="available memory"):
        check_swap_space(3 * GiB, unlimited, {"available_bytes": 2 * GiB})
    check_swap_space(0, {"version": 2, "limit_bytes": 1, "usage_bytes": 2}, {"available_bytes": 0})  # off: no check


def test_text_report_shows_the_allocator_and_the_swap_space_verdict():
    from deepbatch.doctor import format_report

    rep = {"platform": "p", "python": "3", "torch": "t", "cuda": None, "cpus": 2,
           "host_memory": {"total_bytes": 16 * GiB, "available_bytes": 8 * GiB},
           "cgroup_memory": {"version": 2, "limit_bytes": None, "usage_bytes": GiB}, "gpus": [], "gpu_topology": None,
           "kv": {"error": "no model"},
           "gpu_allocator": [{"index": 0, "reserved_bytes": 2 * GiB, "allocated_bytes": GiB,
                              "largest_free_segment_bytes": 512 << 20, "num_segments": 3, "fragmentation_ratio": 0.5}],
           "swap_space": {"bytes": 4 * GiB, "error": "swap_space: too big"}}
    text = format_report(rep)
    assert "allocator  gpu 0: reserved 2.00 GiB, allocated 1.00 GiB, largest free segment 512.0 MiB, " \
           "fragmentation 0.500" in text
    assert "swap space 4.00 GiB: refused: swap_space: too big" in text
