"""``serve_compare``: sweeps of several server configurations side by side."""

from __future__ import annotations

import json

import pytest

from deepbatch.bench import serve_compare


def sweep(path, label, goodputs, controller=None):
    runs = []
    for rate, g in goodputs.items():
        run = {"label": label, "request_rate": rate, "request_throughput": g + 1, "request_goodput": g,
               "p99_ttft_ms": 100.0 * rate, "p99_tpot_ms": 10.0, "requests": {"ttft": [0.1]}}
        if controller:
            run["controller"] = {"settings": controller, "frontier": []}
        runs.append(run)
    path.write_text(json.dumps({"label": label, "sweep": runs}))
    return str(path)


def test_best_fixed_per_rate_and_ratios(tmp_path, capsys):
    files = [sweep(tmp_path / "a.json", "fixed-256", {2.0: 2.0, 4.0: 1.0}),
             sweep(tmp_path / "b.json", "fixed-32", {2.0: 1.5, 4.0: 3.0}),
             sweep(tmp_path / "c.json", "controller", {2.0: 2.0, 4.0: 3.3}, {"max_num_seqs": 45})]
    out = tmp_path / "cmp.json"
    serve_compare.main([*files, "--output-json", str(out), "--plot", str(tmp_path / "cmp.png")])
    result = json.loads(out.read_text())
    by_rate = {r["request_rate"]: r for r in result["rates"]}
    assert by_rate[2.0]["best_fixed"] == "fixed-256" and by_rate[4.0]["best_fixed"] == "fixed-32"
    assert by_rate[4.0]["runs"]["controller"]["vs_best_fixed"] == pytest.approx(1.1)
    assert by_rate[4.0]["runs"]["controller"]["controller_settings"] == {"max_num_seqs": 45}
    assert (tmp_path / "cmp.png").stat().st_size > 0
    assert "controller" in capsys.readouterr().out
