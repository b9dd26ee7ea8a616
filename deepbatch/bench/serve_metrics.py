"""What one serving run measured, summed up and printed the way ``vllm bench serve`` prints it, so
the two can be compared by eye.

Definitions (all per successful request; failed requests count only as failures):
- TTFT: send to the first chunk that carries choices;
- ITL: the gaps between consecutive such chunks (one list over all requests);
- TPOT: (E2E - TTFT) / (output_tokens - 1), the mean decode time per token after the first;
  requests of one token have none;
- E2E: send to the end of the stream.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)
_WIDTH = 50


@dataclass
class RequestResult:
    group: str
    prompt_len: int
    output_len: int  # what was asked for
    send_s: float = 0.0  # offset from the run's start at which the request went out
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (milliseconds in, seconds out)."""
    slo: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
        slo[key] = ms / 1000.0
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return all(values[k] <= limit for k, limit in slo.items())


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)  # nothing measured reads as 0, as in vLLM's report
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in PERCENTILES[1:]:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def latency_stats(results: list[RequestResult]) -> dict[str, float]:
    ok = [r for r in results if r.success]
    out: dict[str, float] = {}
    out.update(_stats("ttft", [r.ttft for r in ok]))
    out.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None]))
    out.update(_stats("itl", [g for r in ok for g in r.itl]))
    out.update(_stats("e2el", [r.e2el for r in ok]))
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration_s
    summary.update(latency_stats(results))
    groups = sorted({r.group for r in results})
    if groups != ["all"]:
        summary["groups"] = {g: group_summary([r for r in results if r.group == g], n_out) for g in groups}
    return summary


def group_summary(results: list[RequestResult], total_output_tokens: int) -> dict:
    ok = [r for r in results if r.success]
    n_out = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": n_out,
        "output_token_share": n_out / total_output_tokens if total_output_tokens else 0.0,
        **latency_stats(results),
    }


def per_request(results: list[RequestResult]) -> dict[str, list]:
    """Column-wise raw results for --output-json, as vLLM's JSON has them."""
    rows = [asdict(r) for r in results]
    return {k: [row[k] for row in rows] for k in rows[0]} if rows else {}


# -- the printed block -----------------------------------------------------------------------------


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^{_WIDTH}}"


def _row(label: str, value) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:<10}"


def _latency_block(title: str, key: str, label: str, s: dict) -> list[str]:
    return [_title(title, "-"),
            _row(f"Mean {label} (ms):", s[f"mean_{key}_ms"]),
            _row(f"Median {label} (ms):", s[f"median_{key}_ms"]),
            *(_row(f"P{p} {label} (ms):", s[f"p{p}_{key}_ms"]) for p in PERCENTILES[1:])]


def format_report(s: dict, workload: str, rate: float, max_concurrency: int | None) -> str:
    lines = [_title(" Serving Benchmark Result ", "="),
             _row("Successful requests:", s["completed"]),
             _row("Failed requests:", s["failed"])]
    if max_concurrency:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines += [_row("Request rate configured (RPS):", rate),
              _row("Benchmark duration (s):", s["duration"]),
              _row("Total input tokens:", s["total_input_tokens"]),
              _row("Total generated tokens:", s["total_output_tokens"]),
              _row("Request throughput (req/s):", s["request_throughput"]),
              _row("Output token throughput (tok/s):", s["output_throughput"]),
              _row("Total Token throughput (tok/s):", s["total_token_throughput"])]
    if "request_goodput" in s:
        lines.append(_row("Request goodput (req/s):", s["request_goodput"]))
    lines += _latency_block("Time to First Token", "ttft", "TTFT", s)
    lines += _latency_block("Time per Output Token (excl. 1st token)", "tpot", "TPOT", s)
    lines += _latency_block("Inter-token Latency", "itl", "ITL", s)
    lines += _latency_block("End-to-end Latency", "e2el", "E2EL", s)
    groups = s.get("groups", {})
    if workload == "hol" and groups:
        lines.append(_title("Head-of-line Blocking", "-"))
        for g in ("short", "long"):
            if g in groups:
                gs = groups[g]
                lines += [_row(f"{g.capitalize()} requests (ok/all):", f"{gs['completed']}/{gs['requests']}"),
                          _row(f"{g.capitalize()} P99 TTFT (ms):", gs["p99_ttft_ms"])]
        if "short" in groups:
            lines += [_row("Short Median ITL (ms):", groups["short"]["median_itl_ms"]),
                      _row("Short P99 ITL (ms):", groups["short"]["p99_itl_ms"])]
    elif workload == "tenants" and groups:
        lines.append(_title("Tenants", "-"))
        for g, gs in groups.items():
            lines += [_row(f"{g} requests (ok/all):", f"{gs['completed']}/{gs['requests']}"),
                      _row(f"{g} output tokens:", gs["output_tokens"]),
                      _row(f"{g} token share (%):", 100.0 * gs["output_token_share"]),
                      _row(f"{g} P99 TTFT (ms):", gs["p99_ttft_ms"])]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def format_sweep(rows: list[dict]) -> str:
    head = f"{'rate':>8} {'req/s':>8} {'goodput':>8} {'out tok/s':>10} {'p99 TTFT':>10} {'p99 TPOT':>10} {'failed':>7}"
    lines = [_title(" Rate Sweep ", "="), head]
    for r in rows:
        good = r.get("request_goodput", r["request_throughput"])
        lines.append(f"{r['request_rate']:>8} {r['request_throughput']:>8.2f} {good:>8.2f} {r['output_throughput']:>10.1f}"
                     f" {r['p99_ttft_ms']:>10.1f} {r['p99_tpot_ms']:>10.2f} {r['failed']:>7}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def plot_sweep(rows: list[dict], path: str, title: str = "") -> None:
    """Goodput (request throughput when no SLO was given) and p99 TTFT/TPOT against the offered
    rate. matplotlib is optional, so it is imported only here."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    finite = [r for r in rows if np.isfinite(r["request_rate"])]
    rates = [r["request_rate"] for r in finite]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(rates, [r["request_throughput"] for r in finite], "o-", label="throughput")
    if finite and "request_goodput" in finite[0]:
        ax1.plot(rates, [r["request_goodput"] for r in finite], "s-", label="goodput")
    ax1.set_xlabel("offered rate (req/s)")
    ax1.set_ylabel("req/s")
    ax1.legend()
    ax1.grid(True, alpha=0.3)
    ax2.plot(rates, [r["p99_ttft_ms"] for r in finite], "o-", label="p99 TTFT")
    ax2.set_ylabel("p99 TTFT (ms)")
    ax2.set_xlabel("offered rate (req/s)")
    ax2.grid(True, alpha=0.3)
    twin = ax2.twinx()  # TTFT and TPOT differ by orders of magnitude
    twin.plot(rates, [r["p99_tpot_ms"] for r in finite], "s--", color="tab:red", label="p99 TPOT")
    twin.set_ylabel("p99 TPOT (ms)")
    ax2.legend(handles=ax2.get_lines() + twin.get_lines(), loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
