"""Put several ``deepbatch bench serve --sweep-rates`` results side by side: one table, one JSON
and one PNG of goodput (and p99 TTFT/TPOT) against the offered rate, one line per server
configuration. This is how the SLO controller is compared with fixed settings: run the same
sweep (same seed, so the same prompts at the same offsets) against a server per setting, each
with ``--label``, then

    python -m deepbatch.bench.serve_compare out/slo-*.json --plot slo.png --output-json slo.json

A run whose label starts with ``fixed`` is a fixed setting; the table marks, per rate, the best
fixed goodput and how each other label compares with it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def load_runs(paths: list[str]) -> dict[str, list[dict]]:
    """label -> its per-rate rows (without per-request data), in rate order."""
    out: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        runs = data.get("sweep", [data])
        label = data.get("label") or runs[0].get("label") or path
        rows = [{k: v for k, v in r.items() if k not in ("requests", "controller")} for r in runs]
        for row, run in zip(rows, runs):
            ctl = run.get("controller")
            if ctl:
                row["controller_settings"] = ctl.get("settings")
        out[label] = sorted(rows, key=lambda r: float(r["request_rate"]))
    return out


def _goodput(row: dict) -> float:
    return float(row.get("request_goodput", row["request_throughput"]))


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per rate: every label's goodput and p99s, the best fixed label, and each label's goodput
    over the best fixed one."""
    rates = sorted({float(r["request_rate"]) for rows in runs.values() for r in rows})
    table = []
    for rate in rates:
        at = {label: next((r for r in rows if float(r["request_rate"]) == rate), None) for label, rows in runs.items()}
        at = {k: v for k, v in at.items() if v is not None}
        fixed = {k: _goodput(v) for k, v in at.items() if k.startswith("fixed")}
        best = max(fixed, key=fixed.get) if fixed else None
        entries = {}
        for label, row in at.items():
            g = _goodput(row)
            entries[label] = {"goodput": g, "p99_ttft_ms": row["p99_ttft_ms"], "p99_tpot_ms": row["p99_tpot_ms"],
                              "vs_best_fixed": g / fixed[best] if best and fixed[best] > 0 else None,
                              "controller_settings": row.get("controller_settings")}
        table.append({"request_rate": rate, "best_fixed": best, "runs": entries})
    return {"labels": list(runs), "rates": table}


def format_table(result: dict) -> str:
    lines = [f"{'rate':>6} {'label':<28} {'goodput':>8} {'p99 TTFT':>9} {'p99 TPOT':>9} {'vs best fixed':>14}"]
    for row in result["rates"]:
        for label, e in row["runs"].items():
            ratio = e["vs_best_fixed"]
            mark = " *" if label == row["best_fixed"] else ""
            lines.append(f"{row['request_rate']:>6g} {label:<28} {e['goodput']:>8.2f} {e['p99_ttft_ms']:>9.1f} "
                         f"{e['p99_tpot_ms']:>9.2f} {'' if ratio is None else f'{ratio:.3f}':>14}{mark}")
    lines.append("* best fixed setting at that rate")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, rows in runs.items():
        rows = [r for r in rows if math.isfinite(float(r["request_rate"]))]
        rates = [float(r["request_rate"]) for r in rows]
        style = "--" if label.startswith("fixed") else "-"
        axes[0].plot(rates, [_goodput(r) for r in rows], "o" + style, label=label)
        axes[1].plot(rates, [r["p99_ttft_ms"] for r in rows], "o" + style, label=label)
        axes[2].plot(rates, [r["p99_tpot_ms"] for r in rows], "o" + style, label=label)
    for ax, ylabel in zip(axes, ("goodput (req/s)", "p99 TTFT (ms)", "p99 TPOT (ms)")):
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deepbatch.bench.serve_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="--output-json files of bench serve sweeps")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.add_argument("--output-json", default=None)
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    try:
        runs = load_runs(args.results)
        result = compare(runs)
        print(format_table(result))
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=1)
        if args.plot:
            plot(runs, args.plot, args.title)
    except (OSError, ValueError, KeyError) as e:
        print(f"serve_compare: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
