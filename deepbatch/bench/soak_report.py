"""The soak's result: outcome counts per kind and per hostile body, latency percentiles, memory
flatness over the run, and the verdict that decides the tool's exit status."""

from __future__ import annotations

import os
import re
from collections import Counter

import numpy as np

from deepbatch.bench.soak_client import KINDS, OUTCOMES

_CONFIG_KEYS = ("url", "model", "server_pid", "duration_s", "rate_multiplier", "disconnect_fraction",
                "hostile_fraction", "non_stream_fraction", "sampling", "workload", "random_input_len",
                "random_output_len", "random_range_ratio", "vocab_size", "prompt_type", "burstiness", "seed",
                "timeout", "num_clients", "warmup_s", "window_s", "flat_tolerance", "flat_tolerance_mib",
                "min_rise_mib", "saturation_s", "saturation_concurrency")


def config(args) -> dict:
    """The flags that shape a run, as the result records them."""
    return {k: v for k, v in vars(args).items() if k in _CONFIG_KEYS}


def percentiles_ms(values) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=float) * 1000.0
    if v.size == 0:
        return {"n": 0}
    return {"n": int(v.size), "mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99)), "max": float(v.max())}


def flatness(samples: list[dict], key: str, warmup_s: float, end_s: float, window_s: float, tolerance: float,
             tolerance_bytes: float | None = None, min_rise: float = 0.0, segments: int = 6) -> dict | None:
    """The first window after warm-up against the last one before ``end_s``: change (relative and
    absolute), least-squares slope, and whether the post-warm-up segment means rise strictly by more
    than ``min_rise`` in all (steady growth, a leak however slow). Flat: |change| within
    ``tolerance`` (and ``tolerance_bytes``: 5% of a GPU's preallocated KV pool would hide gigabytes)
    and no steady growth. None without enough data."""
    pts = [(s["t"], float(s[key])) for s in samples if s.get(key) is not None and warmup_s <= s["t"] <= end_s]
    window = min(window_s, (end_s - warmup_s) / 2.0)
    first = [v for t, v in pts if t <= warmup_s + window]
    last = [v for t, v in pts if t >= end_s - window]
    if len(first) < 2 or len(last) < 2 or len(pts) < segments:
        return None
    t, v = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    slope = float(np.polyfit(t, v, 1)[0]) if np.ptp(t) > 0 else 0.0
    means = [float(m.mean()) for m in np.array_split(v, segments) if m.size]
    rising = all(b > a for a, b in zip(means, means[1:])) and means[-1] - means[0] > min_rise
    f, l = float(np.mean(first)), float(np.mean(last))
    change = (l - f) / f if f else 0.0
    within = abs(change) <= tolerance and (tolerance_bytes is None or abs(l - f) <= tolerance_bytes)
    return {"first_window_mean": f, "last_window_mean": l, "window_s": window, "change": l - f,
            "relative_change": change, "slope_per_min": slope * 60.0,
            "slope_relative_per_10min": slope * 600.0 / f if f else 0.0, "segment_means": means,
            "monotonic_growth": rising, "flat": within and not rising, "num_samples": len(pts)}


def _normalized(message: str) -> str:
    return re.sub(r"\d+", "#", message)[:160]


def summarize(args, soak: dict, rate: float, saturation: dict | None) -> dict:
    records = [r for res in soak["results"] for r in res]
    outcomes = Counter(r["outcome"] for r in records)
    by_kind = {k: dict(Counter(r["outcome"] for r in records if r["kind"] == k)) for k in KINDS}
    hostile: dict[str, dict] = {}
    for r in records:
        if r["kind"] == "hostile":
            h = hostile.setdefault(r["hostile"], {"must_reject": r["must_reject"], "outcomes": Counter(),
                                                   "statuses": Counter()})
            h["outcomes"][r["outcome"]] += 1
            h["statuses"][str(r["status"])] += 1
    errors = {}
    for o in OUTCOMES:
        if o not in ("completed", "disconnected") and outcomes[o]:
            errors[o] = Counter(_normalized(r["error"]) for r in records if r["outcome"] == o).most_common(5)
    completed = [r for r in records if r["outcome"] == "completed" and r["kind"] != "hostile"]
    samples = soak["samples"]
    memory = {k: flatness(samples, k, args.warmup_s, args.duration_s, args.window_s, args.flat_tolerance,
                          args.flat_tolerance_mib * 2 ** 20, args.min_rise_mib * 2 ** 20)
              for k in ("host_rss_bytes", "gpu_allocated_bytes", "gpu_reserved_bytes")}
    end = soak["end_stats"]
    kv_used = ((end or {}).get("kv_cache") or {}).get("used_blocks", 0)
    pid_alive = None
    if args.server_pid is not None:
        try:
            os.kill(args.server_pid, 0)
            pid_alive = True
        except OSError:
            pid_alive = False
    checked = [m["flat"] for k, m in memory.items() if m is not None and k != "gpu_reserved_bytes"]
    must = [r for r in records if r["kind"] == "hostile" and r["must_reject"]]
    verdict = {
        "every_request_ended": len(records) == soak["sent"],
        "zero_5xx": outcomes["http_5xx"] + outcomes["error_event_5xx"] == 0,
        "zero_lost": outcomes["lost"] == 0,
        "kv_zero_at_end": end is not None and end["kv_cache_usage"] == 0 and kv_used == 0,
        "memory_flat": all(checked) if checked else None,
        "hostile_rejected": all(r["outcome"].startswith("rejected_") for r in must),
        "no_connect_errors": outcomes["connect_error"] == 0,
        "scrapes_ok": not soak["scrapes"],
        "server_alive": soak["health"] == 200 and pid_alive is not False,
    }
    verdict["passed"] = all(v is True for v in verdict.values())
    return {
        "config": config(args),
        "saturation": saturation, "rate": rate, "duration_s": args.duration_s, "load_end_s": soak["load_end_s"],
        "sent": soak["sent"], "recorded": len(records), "outcomes": {o: outcomes[o] for o in OUTCOMES},
        "by_kind": by_kind,
        "hostile": {k: {**v, "outcomes": dict(v["outcomes"]), "statuses": dict(v["statuses"])}
                    for k, v in hostile.items()},
        "latency_ms": {"ttft": percentiles_ms(r["ttft"] for r in completed if r["kind"] == "stream"),
                       "e2e": percentiles_ms(r["end"] - r["send"] for r in completed),
                       "send_lag": percentiles_ms(max(0.0, r["send"] - r["at"]) for r in records)},
        "errors": errors, "scrape_errors": dict(soak["scrapes"]),
        "end_state": {"idle_after_s": soak["idle_after_s"], "stats": end, "health_status": soak["health"],
                      "server_pid_alive": pid_alive},
        "memory": memory, "verdict": verdict, "samples": samples,
    }


def format_report(r: dict) -> str:
    sat = r["saturation"]
    lines = [f"Soak: {r['duration_s']:g} s at {r['rate']:.2f} req/s"
             + (f" ({r['config']['rate_multiplier']:g} x saturation {sat['rate']:.2f} req/s)" if sat else "")
             + f", {r['sent']} requests sent, {r['recorded']} ended", f"{'outcome':<18}{'count':>10}{'share':>9}"]
    for o, n in r["outcomes"].items():
        lines.append(f"{o:<18}{n:>10}{n / max(r['recorded'], 1):>9.2%}")
    t = r["latency_ms"]["ttft"]
    if t.get("n"):
        lines.append(f"TTFT ms (completed streams): p50 {t['p50']:.0f}  p90 {t['p90']:.0f}  p99 {t['p99']:.0f}")
    lag = r["latency_ms"]["send_lag"]
    if lag.get("n"):
        lines.append(f"client send lag ms: p99 {lag['p99']:.1f}  max {lag['max']:.1f}")
    for k, m in r["memory"].items():
        if m is not None:
            lines.append(f"{k:<20} first {m['first_window_mean'] / 2 ** 20:9.1f} MiB  last "
                         f"{m['last_window_mean'] / 2 ** 20:9.1f} MiB  change {m['change'] / 2 ** 20:+.1f} MiB "
                         f"({m['relative_change']:+.2%})  "
                         f"slope {m['slope_per_min'] / 2 ** 20:+.2f} MiB/min  {'flat' if m['flat'] else 'NOT FLAT'}")
    e = r["end_state"]
    kv = (e["stats"] or {}).get("kv_cache_usage")
    idle = f"{e['idle_after_s']:.2f} s" if e["idle_after_s"] is not None else "never"
    lines.append(f"end: KV usage {kv}, idle after {idle}, /health {e['health_status']}")
    lines.append("verdict: " + ", ".join(f"{k} {'PASS' if v else ('n/a' if v is None else 'FAIL')}"
                                         for k, v in r["verdict"].items()))
    return "\n".join(lines)
