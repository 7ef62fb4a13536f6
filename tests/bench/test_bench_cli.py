"""The command line end to end: serve, compare (servers launched and stopped), plot."""

from __future__ import annotations

import gzip
import json
import os
import shlex
import sys
from pathlib import Path

from bench_standin import StandIn, ThreadedServer, free_port

from pdserve.bench.cli import main
from pdserve.bench.report import result_header

STANDIN = Path(__file__).parent / "bench_standin.py"
TOP_KEYS = {"ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "request_throughput",
            "output_token_throughput", "slo_attainment", "git_revision", "device", "config",
            "workload", "samples"}


def test_serve_writes_json_report_and_plots(tmp_path):
    out = tmp_path / "run.json"
    with ThreadedServer(StandIn(prefill_ms=10.0, itl_ms=5.0)) as server:
        code = main(["serve", "--base-url", server.url, "--dataset-name", "random",
                     "--num-prompts", "8", "--random-input-len", "16",
                     "--random-output-len", "4", "--request-rate", "20",
                     "--ttft-slo-ms", "500", "--itl-slo-ms", "100", "--no-progress",
                     "--timeline-interval-ms", "20", "--out", str(out),
                     "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    result = json.loads(out.read_text())
    assert TOP_KEYS <= set(result)
    assert result["completed"] == 8 and result["slo_attainment"] == 1.0
    assert set(result["ttft_ms"]) >= {"mean", "p50", "p90", "p99"}
    assert any("standin_num_requests_running" in s for s in result["timeline"])
    assert (tmp_path / "run.md").read_text().count("|") > 10
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert "tradeoff_random.png" in pngs and any(p.startswith("timeline_") for p in pngs)


def test_serve_goodput_sweep_and_plot_mode(tmp_path):
    # 5 req/s: no queue, TTFT ~100 ms, 200 ms under the SLO for a busy host's delays (with
    # 40 ms and an SLO of 120 ms, a loaded host missed it). 60 req/s: request k of 10 waits
    # ~100 + 83k ms, so most miss it.
    out = tmp_path / "goodput.json"
    with ThreadedServer(StandIn(prefill_ms=100.0, itl_ms=2.0)) as server:
        main(["serve", "--base-url", server.url, "--num-prompts", "10",
              "--random-input-len", "8", "--random-output-len", "2", "--burstiness", "100",
              "--ttft-slo-ms", "300", "--itl-slo-ms", "100", "--goodput",
              "--goodput-rates", "5,60", "--no-progress", "--no-timeline", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["goodput_rps"] == 5.0
    assert [p["rate"] for p in result["goodput"]["points"]] == [5.0, 60.0]
    assert main(["plot", str(out), "--plot-dir", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "attainment_random.png").exists()
    packed = tmp_path / "goodput.json.gz"  # large committed results are kept compressed
    packed.write_bytes(gzip.compress(out.read_bytes()))
    assert main(["plot", str(packed)]) == 0
    assert (tmp_path / "goodput_plots" / "attainment_random.png").exists()


def test_compare_starts_and_stops_each_server(tmp_path):
    out = tmp_path / "cmp.json"
    template = f"{shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} {{model}} " \
               "--port {port}"
    code = main(["compare", "--server-cmd", template, "--port", str(free_port()),
                 "--config", "fast=--prefill-ms 5", "--config", "slow=--prefill-ms 60",
                 "--server-arg", "--itl-ms 2", "--startup-timeout-s", "60",
                 "--workload", "random:num=6,rate=30,input_len=8,output_len=3",
                 "--workload", "sharegpt:num=4,rate=inf,label=chat,max_context=64",
                 "--ttft-slo-ms", "100", "--itl-slo-ms", "50", "--no-progress",
                 "--out", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    result = json.loads(out.read_text())
    runs = {(r["name"], r["workload"]["label"] or r["workload"]["dataset"]): r
            for r in result["runs"]}
    assert set(runs) == {("fast", "random"), ("fast", "chat"), ("slow", "random"),
                         ("slow", "chat")}
    assert all("error" not in r for r in runs.values())
    assert runs["fast", "random"]["ttft_ms"]["p50"] < runs["slow", "random"]["ttft_ms"]["p50"]
    assert (tmp_path / "cmp_logs" / "slow.log").read_text().startswith("$ ")
    assert (tmp_path / "plots" / "tradeoff_chat.png").exists()
    assert "| slow | chat |" in (tmp_path / "cmp.md").read_text()


def test_compare_reports_a_server_that_never_starts(tmp_path, capsys):
    out = tmp_path / "bad.json"
    template = f"{shlex.quote(sys.executable)} -c 'raise SystemExit(3)' {{model}} {{port}}"
    code = main(["compare", "--server-cmd", template, "--config", "broken=",
                 "--num-prompts", "2", "--no-progress", "--out", str(out)])
    assert code == 1
    assert "broken / random: not run: server exited with 3" in capsys.readouterr().err
    run = json.loads(out.read_text())["runs"][0]
    assert run["name"] == "broken" and "exited with 3" in run["error"]


def test_result_header_names_the_opt_in_variables_a_run_had(monkeypatch):
    """Kernels switched on by PDSERVE_* variables must show in every result that used them;
    the revision variable is the header's own field, not an option."""
    for name in [k for k in os.environ if k.startswith("PDSERVE_") or k.startswith("CUDA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PDSERVE_FUSED_ROPE_DECODE", "1")
    monkeypatch.setenv("PDSERVE_GIT_REVISION", "abc")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # CUDA's lazy kernel loading: off
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # where, not how: not an option
    header = result_header({})
    assert header["environment_variables"] == {"CUDA_MODULE_LOADING": "EAGER",
                                               "PDSERVE_FUSED_ROPE_DECODE": "1"}
    assert header["git_revision"] == "abc"
