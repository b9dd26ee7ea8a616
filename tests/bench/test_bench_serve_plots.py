"""The plots ``deepbatch bench serve`` writes beside its JSON, from real runs against the fake
server of test_bench_serve.py, whose pace (first chunk after ``ttft``, then one token every
``itl``) is the reference the plotted throughput is checked against."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from deepbatch.bench import serve_plots
from test_bench_serve import FakeConfig, bench, fake, server_url  # noqa: F401 - fixtures

pytest.importorskip("matplotlib", reason="the plots need matplotlib (the bench and test extras install it)")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_shape(path) -> tuple[int, ...]:
    import matplotlib.image

    return matplotlib.image.imread(str(path)).shape


def test_a_run_writes_its_plots_beside_its_json(fake, server_url, tmp_path, capsys):
    fake.cfg = FakeConfig(ttft=0.05, itl=0.02)
    out = tmp_path / "run.json"
    r = bench(server_url, "--num-prompts", "12", "--max-concurrency", "4", "--random-input-len", "8",
              "--random-output-len", "20", "--output-json", str(out))
    png = tmp_path / "run.png"
    assert r["completed"] == 12
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert png_shape(png)[:2] == (400, 1600)  # one run: one row of three panels, 16 x 4 in at 100 dpi
    assert f"plots: {png}" in capsys.readouterr().err

    # What the throughput panel draws, against the server's known pace: four streams of one token
    # every 20 ms are 200 tokens/s while four are in flight, and the bins hold every token.
    saved = json.loads(out.read_text())
    tl = serve_plots.timeline(saved["requests"], saved["duration"], bin_s=0.1)
    assert np.sum(tl["output_tokens_per_s"] * np.diff(tl["edges"])) == pytest.approx(saved["total_output_tokens"])
    assert tl["in_flight"].max() == fake.peak_active == 4
    # Bins wholly inside the span where four streams are in flight and tokens have begun: the
    # first token's wait is the server's TTFT plus the client's start-up, which a loaded machine
    # stretches, so the pace is read only once tokens flow.
    rate = tl["output_tokens_per_s"]
    flowing = np.arange(len(rate)) >= np.argmax(rate > 0)
    full = rate[(tl["in_flight"] == 4) & flowing][1:-1]
    assert len(full) >= 5 and 150 <= np.median(full) <= 210


def test_a_sweep_has_a_row_per_rate(fake, server_url, tmp_path):
    fake.cfg = FakeConfig(itl=0.005)
    bench(server_url, "--num-prompts", "5", "--random-output-len", "4", "--sweep-rates", "20,inf",
          "--output-json", str(tmp_path / "sweep.json"))
    assert png_shape(tmp_path / "sweep.png")[:2] == (800, 1600)


def test_plot_names_the_same_file_the_sweep_plot_is_kept(fake, server_url, tmp_path, capsys):
    bench(server_url, "--num-prompts", "3", "--random-output-len", "2", "--sweep-rates", "20",
          "--output-json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"))
    assert png_shape(tmp_path / "s.png")[:2] == (480, 1320)  # plot_sweep's 11 x 4 in at 120 dpi
    assert "per-run plots are not written" in capsys.readouterr().err


def test_no_plots_and_no_matplotlib_still_write_the_json(fake, server_url, tmp_path, monkeypatch, capsys):
    bench(server_url, "--num-prompts", "2", "--random-output-len", "2", "--output-json", str(tmp_path / "a.json"),
          "--no-plots")
    assert (tmp_path / "a.json").exists() and not (tmp_path / "a.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    r = bench(server_url, "--num-prompts", "2", "--random-output-len", "2", "--output-json", str(tmp_path / "b.json"))
    assert json.loads((tmp_path / "b.json").read_text())["completed"] == r["completed"] == 2
    assert not (tmp_path / "b.png").exists()
    assert "no plots: plots need matplotlib" in capsys.readouterr().err


def test_the_plots_never_take_the_json_name():
    assert serve_plots.plot_path("out/run.json") == "out/run.png"
    assert serve_plots.plot_path("results") == "results.png"
    assert serve_plots.plot_path("weird.png") == "weird.png.png"
