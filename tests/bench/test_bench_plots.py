"""Plots: what each figure shows, and the tool without matplotlib (an optional extra)."""

from __future__ import annotations

import json
import sys

import pytest
from bench_standin import StandIn, ThreadedServer

from pdserve.bench.cli import main


def _run(name: str, slo: dict, itl_p99: float, ttft_p99: float) -> dict:
    return {"name": name, "slo": slo, "itl_ms": {"p99": itl_p99}, "ttft_ms": {"p99": ttft_p99}}


def _legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def test_tradeoff_explains_filled_points_only_when_there_are_slos():
    from pdserve.bench.plots import tradeoff_figure

    no_slo = tradeoff_figure([_run("a", {}, 20, 300), _run("b", {}, 30, 90)], "w")
    assert _legend_texts(no_slo.axes[0]) == ["a", "b"]
    assert "filled" not in no_slo.axes[0].get_title()
    slo = {"ttft_ms": 200, "itl_ms": 50}
    with_slo = tradeoff_figure([_run("a", slo, 20, 300), _run("b", slo, 30, 90)], "w")
    texts = _legend_texts(with_slo.axes[0])
    assert {"ITL SLO", "TTFT SLO", "meets both SLOs at P99", "misses an SLO at P99"} <= set(texts)
    hollow, filled = (c.get_facecolors()[0] for c in with_slo.axes[0].collections[:2])
    assert tuple(hollow) == (1, 1, 1, 1) and tuple(filled) != (1, 1, 1, 1)  # a misses TTFT


def test_timeline_puts_each_unit_on_its_own_axis_and_drops_zero_series():
    from pdserve.bench.plots import timeline_figure

    samples = [{"t": t, "pdserve_num_requests_running": r, "pdserve_num_requests_waiting": 0,
                "pdserve_prefill_batch_tokens": 512 * r, "pdserve_kv_cache_usage_ratio": r / 8,
                "pdserve_decode_sms": 0.0} for t, r in enumerate([1, 3, 2, 4])]
    fig = timeline_figure(samples, "run")
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["requests", "tokens", "% (shares)"]
    assert _legend_texts(fig.axes[0]) == ["num_requests_running"]
    assert _legend_texts(fig.axes[1]) == ["prefill_batch_tokens"]
    assert fig.axes[2].get_lines()[0].get_ydata().max() == pytest.approx(50.0)
    assert "decode_sms, num_requests_waiting" in fig.texts[0].get_text()
    assert timeline_figure([{"t": 0, "x_waiting": 0}], "idle") is None


def test_run_writes_the_latency_cdf(tmp_path):
    with ThreadedServer(StandIn(prefill_ms=2.0, itl_ms=2.0)) as server:
        code = main(["serve", "--base-url", server.url, "--num-prompts", "6",
                     "--random-input-len", "8", "--random-output-len", "4", "--no-progress",
                     "--no-timeline", "--plot-dir", str(tmp_path)])
    assert code == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "latency_cdf_random.png", "tradeoff_random.png"]


def test_without_matplotlib_plots_are_refused_and_the_rest_works(tmp_path, monkeypatch,
                                                                 capsys):
    # None in sys.modules makes every import of these fail, as on an install without them.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "pdserve.bench.plots", None)
    standin = StandIn(prefill_ms=1.0, itl_ms=1.0)
    args = ["serve", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len",
            "2", "--no-progress", "--out", str(tmp_path / "r.json")]
    with ThreadedServer(standin) as server:
        refused = main([*args, "--base-url", server.url, "--plot-dir", str(tmp_path / "p")])
        assert refused == 2 and not standin.requests  # refused before the run
        assert capsys.readouterr().err.strip() == \
            "error: plots need matplotlib: pip install 'pdserve[bench]'"
        assert main([*args, "--base-url", server.url]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 2
    assert main(["plot", str(tmp_path / "r.json")]) == 2
