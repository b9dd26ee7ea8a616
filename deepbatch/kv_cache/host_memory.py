"""The host memory a swap space must fit in: this process's cgroup limit and the host's
available memory. Pinned host memory cannot be paged out, so a swap space past either ends in the
OOM killer rather than in slow swapping; the engine refuses it at start (``check_swap_space``)
and ``deepbatch doctor`` reports both figures."""

from __future__ import annotations


def read_sys_file(path: str) -> str | None:
    """A small system file's text, stripped; None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_memory(root: str = "/sys/fs/cgroup") -> dict:
    """The cgroup's memory limit and usage in bytes (v2, else v1); None where unlimited/unknown.
    ``root`` is where the cgroup filesystem is mounted (tests pass a crafted directory)."""
    v2_max, v2_cur = read_sys_file(f"{root}/memory.max"), read_sys_file(f"{root}/memory.current")
    if v2_max is not None:
        return {"version": 2, "limit_bytes": None if v2_max == "max" else int(v2_max),
                "usage_bytes": int(v2_cur) if v2_cur else None}
    v1_max = read_sys_file(f"{root}/memory/memory.limit_in_bytes")
    v1_cur = read_sys_file(f"{root}/memory/memory.usage_in_bytes")
    if v1_max is not None:
        limit = int(v1_max)
        return {"version": 1, "limit_bytes": None if limit >= 1 << 60 else limit,
                "usage_bytes": int(v1_cur) if v1_cur else None}
    return {"version": None, "limit_bytes": None, "usage_bytes": None}


def host_memory(meminfo: str = "/proc/meminfo") -> dict:
    info = {}
    for line in (read_sys_file(meminfo) or "").splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            info[key] = int(rest.split()[0]) * 1024
    return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable")}


def check_swap_space(swap_bytes: int, cgroup: dict | None = None, host: dict | None = None) -> None:
    """Refuse (ValueError) a swap space larger than the memory this process may still take: the
    cgroup's limit minus its usage, and the host's available memory. Pinned memory cannot be
    paged out, so crossing either ends in the OOM killer, not in slow swapping."""
    if swap_bytes <= 0:
        return
    cgroup = cgroup_memory() if cgroup is None else cgroup
    host = host_memory() if host is None else host
    gib = 2**30
    if cgroup.get("limit_bytes") is not None:
        headroom = cgroup["limit_bytes"] - (cgroup.get("usage_bytes") or 0)
        if swap_bytes > headroom:
            raise ValueError(
                f"swap_space: {swap_bytes / gib:.2f} GiB does not fit under the cgroup v{cgroup.get('version')} memory "
                f"limit ({cgroup['limit_bytes'] / gib:.2f} GiB, {max(headroom, 0) / gib:.2f} GiB left); lower --swap-space")
    available = host.get("available_bytes")
    if available is not None and swap_bytes > available:
        raise ValueError(f"swap_space: {swap_bytes / gib:.2f} GiB is more than the host's available memory "
                         f"({available / gib:.2f} GiB); lower --swap-space")
