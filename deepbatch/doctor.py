"""``deepbatch doctor``: what this machine offers and what the current settings would give.

GPUs (name, memory, driver, NUMA node, link topology), the caching allocator's view of each GPU
from this process, host memory and its cgroup limit, whether ``--swap-space`` fits under them,
and the KV capacity the engine settings would yield, estimated from the model config without
loading weights, for the chosen ``--kv-cache-dtype`` and beside it for each other cache format.
Plain text, or ``--json``.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess

import torch

from deepbatch.kv_cache.host_memory import cgroup_memory, check_swap_space, host_memory, read_sys_file


def gpus() -> list[dict]:
    out = []
    if not torch.cuda.is_available():
        return out
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        pci = getattr(p, "pci_bus_id", None)
        numa = None
        if pci is not None:
            numa = read_sys_file(f"/sys/bus/pci/devices/{str(pci).lower()}/numa_node")
        out.append({"index": i, "name": p.name, "total_bytes": total, "free_bytes": free,
                    "compute_capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                    "numa_node": int(numa) if numa not in (None, "-1") else None})
    return out


def gpu_allocators() -> list[dict]:
    """Reserved vs allocated bytes, largest free segment and fragmentation per GPU (this process)."""
    from deepbatch.metrics.allocator import allocator_view

    if not torch.cuda.is_available():
        return []
    snapshot = torch.cuda.memory_snapshot()
    return [{"index": i, **allocator_view(torch.cuda.memory_stats(i), snapshot, i).as_dict()}
            for i in range(torch.cuda.device_count())]


def swap_space(config) -> dict:
    swap_bytes = int(config.cache.swap_space * 2**30)
    try:
        check_swap_space(swap_bytes)
        error = None
    except ValueError as e:
        error = str(e)
    return {"bytes": swap_bytes, "error": error}


def gpu_topology() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout or None
    except (OSError, subprocess.SubprocessError):
        return None


KV_DTYPES_COMPARED = ("auto", "fp8", "int8")


def kv_capacity(config) -> dict:
    """Tokens of KV the settings would give, from the config alone (weights estimated), for the
    configured ``kv_cache_dtype`` and, under ``per_dtype``, for each cache format (an error string
    where the model cannot use one)."""
    from deepbatch.bench.roofline import model_cost
    from deepbatch.layers.quantization import get_quantization_config
    from deepbatch.models.loader import load_hf_config, max_model_len_of, resolve_model

    source = resolve_model(config.model.model)
    hf = load_hf_config(source, config.model.cache_dir)
    elem = torch.tensor([], dtype=config.model.dtype).element_size()
    chosen = config.cache.kv_cache_dtype
    quant = get_quantization_config(hf, config.model.quantization)
    weight_bits = quant.weight_bits() if quant is not None else None
    cost = model_cost(hf, elem, chosen, weight_bits)
    if config.device.startswith("cuda") and torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info()
        budget = total * config.cache.gpu_memory_utilization - cost.weight_bytes
    else:
        budget = config.cache.cpu_kv_cache_bytes
    per_dtype = {}
    for name in dict.fromkeys((chosen, *KV_DTYPES_COMPARED)):
        try:
            per_token = model_cost(hf, elem, name, weight_bits).kv_bytes_per_token
        except ValueError as e:
            per_dtype[name] = {"error": str(e)}
            continue
        per_dtype[name] = {"kv_bytes_per_token": per_token, "kv_capacity_tokens": max(int(budget // per_token), 0)}
    return {"model": source.name, "weights": quant.describe() if quant is not None else str(config.model.dtype),
            "kv_cache_dtype": chosen, "kv_bytes_per_token": cost.kv_bytes_per_token,
            "weight_bytes_estimate": cost.weight_bytes, "kv_budget_bytes": budget,
            "kv_capacity_tokens": per_dtype[chosen]["kv_capacity_tokens"], "per_dtype": per_dtype,
            "max_model_len": max_model_len_of(hf, config.model.max_model_len)}


def report(config) -> dict:
    rep = {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cpus": os.cpu_count(), "host_memory": host_memory(),
        "cgroup_memory": cgroup_memory(), "gpus": gpus(), "gpu_topology": gpu_topology(),
        "gpu_allocator": gpu_allocators(), "swap_space": swap_space(config),
    }
    try:
        rep["kv"] = kv_capacity(config)
    except Exception as e:  # a missing model is reported, not fatal
        rep["kv"] = {"error": str(e)}
    return rep


def format_report(rep: dict) -> str:
    gib = 2**30
    lines = [f"platform   {rep['platform']}  python {rep['python']}  torch {rep['torch']}  cuda {rep['cuda']}",
             f"cpus       {rep['cpus']}"]
    hm, cg = rep["host_memory"], rep["cgroup_memory"]
    if hm["total_bytes"]:
        lines.append(f"memory     {hm['total_bytes'] / gib:.1f} GiB total, {hm['available_bytes'] / gib:.1f} GiB available")
    limit = f"{cg['limit_bytes'] / gib:.1f} GiB" if cg["limit_bytes"] else "none"
    usage = f"{cg['usage_bytes'] / gib:.1f} GiB" if cg["usage_bytes"] else "unknown"
    lines.append(f"cgroup     v{cg['version']} limit {limit}, usage {usage}")
    for g in rep["gpus"] or []:
        lines.append(f"gpu {g['index']}      {g['name']} ({g['compute_capability']}, {g['multiprocessors']} SMs), "
                     f"{g['total_bytes'] / gib:.1f} GiB, {g['free_bytes'] / gib:.1f} free, NUMA {g['numa_node']}")
    if not rep["gpus"]:
        lines.append("gpu        none")
    for a in rep.get("gpu_allocator") or []:
        lines.append(f"allocator  gpu {a['index']}: reserved {a['reserved_bytes'] / gib:.2f} GiB, allocated "
                     f"{a['allocated_bytes'] / gib:.2f} GiB, largest free segment "
                     f"{a['largest_free_segment_bytes'] / 2**20:.1f} MiB, fragmentation {a['fragmentation_ratio']:.3f}")
    sw = rep.get("swap_space")
    if sw and sw["bytes"]:
        lines.append(f"swap space {sw['bytes'] / gib:.2f} GiB: " + (f"refused: {sw['error']}" if sw["error"] else "fits"))
    if rep["gpu_topology"]:
        lines += ["topology", rep["gpu_topology"].rstrip()]
    kv = rep["kv"]
    if "error" in kv:
        lines.append(f"kv         unavailable: {kv['error']}")
    else:
        lines.append(f"weights    {kv['model']}: {kv['weights']}, about {kv['weight_bytes_estimate'] / gib:.2f} GiB")
        lines.append(f"kv         {kv['model']}, kv_cache_dtype {kv['kv_cache_dtype']}: "
                     f"{kv['kv_bytes_per_token'] / 1024:.1f} KiB per token, budget "
                     f"{kv['kv_budget_bytes'] / gib:.2f} GiB -> {kv['kv_capacity_tokens']:,} tokens "
                     f"({kv['kv_capacity_tokens'] / max(kv['max_model_len'], 1):.1f} full contexts of {kv['max_model_len']})")
        for name, d in kv.get("per_dtype", {}).items():
            if "error" in d:
                lines.append(f"  {name:<8} unavailable: {d['error']}")
            else:
                lines.append(f"  {name:<8} {d['kv_bytes_per_token'] / 1024:.2f} KiB per token -> "
                             f"{d['kv_capacity_tokens']:,} tokens")
    return "\n".join(lines)


def run(config, as_json: bool) -> int:
    rep = report(config)
    print(json.dumps(rep, indent=2) if as_json else format_report(rep))
    return 0
