"""The latency and throughput plots ``deepbatch bench serve`` writes beside its JSON
(``--output-json X.json`` -> ``X.png``): one row per run (per rate of a sweep), drawn from the
per-request columns the JSON holds, so a saved JSON can be plotted again with ``plot_runs``.

- latency over the run: each request's TTFT and TPOT at the time it was sent, with the run's p50
  and p99 (the same numbers the printed block reports);
- output throughput over the run: every output chunk's arrival, binned (a chunk carries
  output_tokens / chunks tokens, so the bins add up to the run's output tokens), and the
  requests in flight;
- the latency distributions: CDFs of TTFT, TPOT and E2E latency.

matplotlib is optional: it is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

# Bins over a run: enough to show its shape, none so short that it holds only a chunk or two.
_BINS = 60
_MIN_BIN_S = 0.25


def plot_path(output_json: str) -> str:
    """Where the plots of ``--output-json output_json`` go: the same name, ``.png`` (added, not
    swapped in, when the JSON's own name ends in ``.png``, so it is never overwritten)."""
    p = Path(output_json)
    return str(p) + ".png" if p.suffix == ".png" else str(p.with_suffix(".png"))


def _ok(requests: dict) -> list[int]:
    return [i for i, ok in enumerate(requests.get("success", [])) if ok]


def chunk_times(requests: dict) -> tuple[np.ndarray, np.ndarray]:
    """(seconds from the run's start, tokens) of every output chunk of the successful requests."""
    times, tokens = [], []
    for i in _ok(requests):
        first = requests["send_s"][i] + requests["ttft"][i]
        arrivals = first + np.concatenate([[0.0], np.cumsum(requests["itl"][i])])
        times.append(arrivals)
        tokens.append(np.full(len(arrivals), requests["output_tokens"][i] / len(arrivals)))
    if not times:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(times), np.concatenate(tokens)


def timeline(requests: dict, duration_s: float, bin_s: float | None = None) -> dict[str, np.ndarray]:
    """Output tokens/s and requests in flight over the run, in bins of ``bin_s`` seconds
    (default: the run in ``_BINS`` bins of at least ``_MIN_BIN_S``); ``edges`` holds the bins'
    bounds, the last one the run's end."""
    if bin_s is None:
        bin_s = max(duration_s / _BINS, _MIN_BIN_S)
    duration_s = max(duration_s, 1e-3)
    n = max(1, math.ceil(duration_s / bin_s))
    # The last bin ends with the run, so its rate is over the time it covers.
    edges = np.minimum(np.arange(n + 1) * bin_s, duration_s)
    times, tokens = chunk_times(requests)
    per_bin, _ = np.histogram(times, bins=edges, weights=tokens)
    # Requests in flight at each bin's middle: sent, and not yet ended (failures end at send).
    mid = (edges[:-1] + edges[1:]) / 2
    sent = np.asarray(requests.get("send_s", []), dtype=float)
    ended = sent + np.asarray(requests.get("e2el", []), dtype=float)
    in_flight = ((sent[None, :] <= mid[:, None]) & (mid[:, None] < ended[None, :])).sum(axis=1)
    return {"t": edges[:-1], "edges": edges, "output_tokens_per_s": per_bin / np.diff(edges), "in_flight": in_flight}


def _title(run: dict) -> str:
    rate = run.get("request_rate")
    rate_text = "inf" if rate in (None, "inf") or (isinstance(rate, float) and math.isinf(rate)) else f"{rate:g}"
    return f"rate {rate_text} req/s: {run['completed']} ok, {run['failed']} failed"


def _log_axis(axis, set_scale) -> None:
    """A log scale labelled in plain numbers (1, 2, 5, 10, 20 ...), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    set_scale("log")
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _latency_panel(ax, run: dict) -> None:
    req = run["requests"]
    ok = _ok(req)
    sent = [req["send_s"][i] for i in ok]
    ax.scatter(sent, [1000.0 * req["ttft"][i] for i in ok], s=10, label="TTFT")
    tpot = [(req["send_s"][i], 1000.0 * (req["e2el"][i] - req["ttft"][i]) / (req["output_tokens"][i] - 1))
            for i in ok if req["output_tokens"][i] >= 2]
    if tpot:
        ax.scatter(*zip(*tpot), s=10, marker="s", color="tab:red", label="TPOT")
    for key, color in (("ttft", "tab:blue"), ("tpot", "tab:red")):
        for p, style in (("median", ":"), ("p99", "--")):
            value = run.get(f"{p}_{key}_ms")
            if value:
                ax.axhline(value, color=color, linestyle=style, linewidth=1)
    failed = [req["send_s"][i] for i, s in enumerate(req.get("success", [])) if not s]
    if failed:
        ax.scatter(failed, [run.get("p99_ttft_ms") or 1.0] * len(failed), marker="x", color="black", label="failed")
    if ok:
        _log_axis(ax.yaxis, ax.set_yscale)  # TTFT and TPOT differ by orders of magnitude
    ax.set_xlabel("sent at (s from start)")
    ax.set_ylabel("ms (dotted p50, dashed p99)")
    ax.set_title(_title(run), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)


def _throughput_panel(ax, run: dict) -> None:
    tl = timeline(run["requests"], float(run["duration"]))
    ax.stairs(tl["output_tokens_per_s"], tl["edges"], label="output tokens/s")
    ax.axhline(run["output_throughput"], color="tab:blue", linestyle="--", linewidth=1, label="run mean")
    ax.set_xlabel("s from start")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    twin = ax.twinx()
    twin.stairs(tl["in_flight"], tl["edges"], color="tab:orange", label="in flight")
    twin.set_ylabel("requests in flight")
    twin.set_ylim(bottom=0)
    twin.yaxis.get_major_locator().set_params(integer=True)
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, fontsize=8, loc="lower left")


def _cdf_panel(ax, run: dict) -> None:
    req = run["requests"]
    ok = _ok(req)
    series = {"TTFT": [req["ttft"][i] for i in ok], "E2E": [req["e2el"][i] for i in ok],
              "TPOT": [(req["e2el"][i] - req["ttft"][i]) / (req["output_tokens"][i] - 1)
                       for i in ok if req["output_tokens"][i] >= 2]}
    for label, values in series.items():
        if values:
            ms = np.sort(np.asarray(values) * 1000.0)
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=label)
    if ok:
        _log_axis(ax.xaxis, ax.set_xscale)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, alpha=0.3)


def plot_runs(runs: list[dict], path: str, title: str = "") -> None:
    """One row of three panels per run (``runs``: bench serve results with their ``requests``)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 3, figsize=(16, 4 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs):
        _latency_panel(row[0], run)
        _throughput_panel(row[1], run)
        _cdf_panel(row[2], run)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(result: dict, output_json: str) -> str:
    """Plot a bench serve result (one run, or a sweep) beside its JSON; returns the file."""
    runs = result.get("sweep", [result])
    path = plot_path(output_json)
    plot_runs(runs, path, title=f"{result['workload']} - {result['model']}")
    return path
