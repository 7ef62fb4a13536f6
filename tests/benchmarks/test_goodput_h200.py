"""benchmarks/goodput_h200.py end to end on the tiny model (real server processes, CPU), and
its summary on records whose answers are known."""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_scripts import _load

from pdserve.bench.evidence import load_records


@pytest.fixture()
def tool(monkeypatch):
    module = _load("goodput_h200")
    tiny = module.ProbeWorkload(
        "tiny", "random:input_len=24,range_ratio=0.5,output_len=4,output_range_ratio=0",
        ttft_slo_ms=60_000.0, span_s=1.0, min_requests=3, max_requests=6, drain_s=20.0,
        ladder=(0.01, 2.0, 4.0, 8.0), start_rate=4.0)
    monkeypatch.setitem(module.WORKLOADS, "tiny", tiny)
    monkeypatch.setitem(module.CONFIGS, "chunk16", "--schedule chunked --chunk-size 16")
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tool, tmp_path, *targets: str, budget_s: float = 240.0) -> int:
    """``targets``: ``W:C:R`` probes, or ``search=W:C`` searches (two probes at most)."""
    argv = ["run", "--model", "tiny", "--server-args", "", "--port", str(_free_port()),
            "--results", str(tmp_path), "--budget-s", str(budget_s), "--startup-s", "60",
            "--max-probes", "2"]
    for target in targets:
        kind, _, text = target.rpartition("=")
        argv += [f"--{kind or 'probe'}", text]
    return tool.main(argv)


@pytest.mark.slow
def test_probes_run_record_skip_and_respect_the_budget(tool, tmp_path, capsys, monkeypatch):
    # A CPU's TPOT is whatever the shared host allows: an SLO every run meets makes the
    # search's path (4, then 8 req/s) independent of timing.
    monkeypatch.setattr(tool, "TPOT_SLO_MS", 1e9)
    monkeypatch.setattr(tool, "FIGURE3_ITL_MS", (1e9,))
    # The search starts at 4 req/s; everything passes (TTFT SLO 60 s), so it doubles to 8.
    # 0.01 req/s: three requests 100 s apart, past what the budget leaves: never started.
    assert _run(tool, tmp_path, "search=tiny:chunk16", "tiny:chunk16:0.01") == 0
    out = capsys.readouterr().out
    assert re.search(r"budget: tiny:chunk16:0.01 needs ~\d+ s", out)
    records = {r["probe"]["rate"]: r for r in load_records(tmp_path)}
    assert sorted(records) == [4.0, 8.0]
    for rate, record in records.items():
        assert record["probe"] == {"workload": "tiny", "config": "chunk16", "rate": rate,
                                   "requests": 4 if rate == 4.0 else 6}
        assert record["config"]["server_args"] == "--schedule chunked --chunk-size 16"
        assert "--chunk-size" in record["config"]["server_command"]
        assert record["config"]["server_command"][0] == "python"  # no host install path
        assert record["git_revision"] and record["device"] and record["command"]
        assert record["workload"]["definition"]["span_s"] == 1.0
        assert all(s["success"] and s["output_tokens"] == 4 for s in record["samples"])
        assert record["summary"]["completed"] == record["probe"]["requests"]
    # Recorded probes are skipped and an ended search (8 is the top rung) asks for nothing:
    # no server is started for them.
    # One server served both rates (chunked prefill learns nothing online).
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["tiny__chunk16__r4.log"]
    (tmp_path / "logs" / "tiny__chunk16__r4.log").unlink()
    assert _run(tool, tmp_path, "tiny:chunk16:4", "search=tiny:chunk16") == 0
    assert not any((tmp_path / "logs").iterdir())
    assert "attainment" not in capsys.readouterr().out


@pytest.mark.slow
def test_each_fresh_server_of_a_repeated_probe_keeps_its_own_log(tool, tmp_path, monkeypatch):
    """A server that learns online starts again for each probe; its log is named after the
    record the probe writes, so a repeat's log does not replace the first run's."""
    monkeypatch.setattr(tool, "TPOT_SLO_MS", 1e9)
    monkeypatch.setattr(tool, "learns_online", lambda config: True)
    probe = "tiny:chunk16:4"  # the first run, then its repeat: two servers in one call
    assert tool.main(["run", "--model", "tiny", "--server-args", "", "--port",
                      str(_free_port()), "--results", str(tmp_path), "--budget-s", "240",
                      "--startup-s", "60", "--probe", probe, "--probe", probe,
                      "--repeat"]) == 0
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["tiny__chunk16__r4.log", "tiny__chunk16__r4__rep2.log"]
    assert sorted(p.stem for p in tmp_path.glob("tiny__*.json")) == [
        log.removesuffix(".log") for log in logs]


@pytest.mark.slow
def test_a_slo_order_probe_serves_with_its_workload_s_ttft_slo(tool, tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "TPOT_SLO_MS", 1e9)
    monkeypatch.setitem(tool.CONFIGS, "chunk16-slo", tool.CONFIGS["chunk16"]
                        + tool.SLO_ORDER_ARGS)
    assert _run(tool, tmp_path, "tiny:chunk16-slo:4") == 0
    (record,) = load_records(tmp_path)
    assert record["config"]["server_args"] == ("--schedule chunked --chunk-size 16 "
                                               "--ttft-slo-ms 60000 --prefill-order slo")
    assert record["config"]["engine"]["prefill_order"] == "slo"
    assert record["prefill_order"]["prefill_order"] == "slo"
    assert record["summary"]["completed"] == record["probe"]["requests"]


def test_bad_probes_are_refused_by_name(tool, tmp_path):
    with pytest.raises(SystemExit, match="unknown config 'chunk7'"):
        tool.parse_probe("loogle:chunk7:0.3")
    with pytest.raises(SystemExit, match="unknown workload"):
        tool.parse_search("nope:chunk512")
    with pytest.raises(SystemExit, match="bad rate"):
        tool.parse_probe("loogle:chunk512:-1")
    with pytest.raises(SystemExit, match="Mooncake trace is not at"):
        tool.main(["run", "--probe", "mooncake:chunk512:0.5", "--budget-s", "10",
                   "--trace-path", str(tmp_path / "none.jsonl")])



def test_every_multiplex_config_serves_to_the_itl_its_name_gives():
    module = _load("goodput_h200")
    for name in ("multiplex-itl60", "multiplex-temporal-itl60", "multiplex-graph-itl60",
                 "multiplex-graph-converging-itl60"):
        assert module.itl_target(name) == 60.0
        assert "--itl-slo-ms 60" in module.CONFIGS[name]
    assert "--mux-sharing temporal" in module.CONFIGS["multiplex-temporal-itl60"]
    assert "--mux-graph-step-tokens 256" in module.CONFIGS["multiplex-graph-itl60"]
    converging = _flags(module.CONFIGS["multiplex-graph-converging-itl60"])
    compounding = _flags(module.CONFIGS["multiplex-graph-itl60"])
    assert converging.pop("--mux-prefill-correction") == "converging"
    assert compounding.pop("--mux-prefill-correction") == "compounding"
    assert converging == compounding
    assert module.itl_target("chunk256") is None and module.itl_target("multiplex-itl") is None


def test_every_config_is_a_valid_server_command_line():
    """Each configuration's flags, as a probe's server gets them, parse with ``pdserve
    serve``'s own parser into a scheduler config that accepts them (a flag renamed, or one
    that needs another, fails here rather than on the GPU)."""
    import shlex

    from pdserve.cli import _config_from_args, build_parser
    from pdserve.config import SchedulerConfig

    module, parser = _load("goodput_h200"), build_parser()
    for name, template in module.CONFIGS.items():
        args = template.format(predictor="profile.json", ttft_slo_ms=2000)
        parsed = parser.parse_args(["serve", "codellama-34b", *shlex.split(module.SERVER_ARGS),
                                    *shlex.split(args)])
        try:
            _config_from_args(SchedulerConfig, parsed)  # raises on a combination it refuses
        except ValueError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
    bank = _flags(module.CONFIGS["multiplex-graph512-floor-converging-noslice-bank2q5-itl60"])
    assert (bank["--mux-tpot-bank-cap"], bank["--mux-tpot-bank-quantile"]) == ("2", "0.05")
    reweigh = _flags(module.CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-itl60"])
    plain = _flags(module.CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"])
    assert reweigh.pop("--mux-reweigh-spatial-batches") == "on"
    assert plain.pop("--no-mux-reweigh-spatial-batches") == "on"  # the default until 8a6ad63
    assert reweigh == plain
    # The defaults after 8a6ad63 are B2's flags: a server given none of them runs B2.
    from pdserve.sim.mux_steps import scheduler_config
    b2_args = module.CONFIGS[module.TABLE_CONFIGS[0]].format(predictor="p.json",
                                                             ttft_slo_ms=2000)
    b2, named = _flags(b2_args), scheduler_config(b2_args)
    default = scheduler_config(" ".join(f"{k} {v}" for k, v in b2.items() if k in (
        "--itl-slo-ms", "--ttft-slo-ms")))
    for field in ("mux_tpot_bank_cap", "mux_co_running_correction",
                  "mux_reweigh_spatial_batches"):
        assert getattr(named, field) == getattr(default, field), field
    assert (named.tpot_bank_quantile(), named.ttft_pressed_margin()) == (
        default.tpot_bank_quantile(), default.ttft_pressed_margin())


def _flags(args: str) -> dict[str, str]:
    """``--flag value`` pairs; a switch (``--flag`` with no value) reads ``"on"``."""
    words, flags = args.split(), {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) else "--"
            flags[word] = "on" if value.startswith("--") else value
    return flags


def test_the_floor_configs_differ_only_by_the_floor_from_what_they_are_compared_with():
    configs = _load("goodput_h200").CONFIGS
    pairs = [("multiplex-graph-floor-itl60", "multiplex-graph-itl60"),
             ("multiplex-graph-floor-converging-itl60", "multiplex-graph-converging-itl60")]
    for floor, without in pairs:
        with_floor, without_floor = _flags(configs[floor]), _flags(configs[without])
        assert with_floor.pop("--mux-mixed-floor-tokens") == "256"
        assert without_floor.pop("--mux-mixed-floor-tokens") == "0"
        assert with_floor == without_floor
    window = _flags(configs["multiplex-graph-floor-window32-itl60"])
    assert window.pop("--mux-correction-window") == "32"
    assert window == _flags(configs["multiplex-graph-floor-itl60"])
    for guarded, plain in [("multiplex-graph-floor-guarded-itl60", "multiplex-graph-floor-itl60"),
                           ("multiplex-graph-floor-guarded-converging-itl60",
                            "multiplex-graph-floor-converging-itl60")]:
        flags = _flags(configs[guarded])
        assert (flags.pop("--mux-stall-ratio"), flags.pop("--mux-correction-half-life")) == (
            "3", "100")
        assert flags == _flags(configs[plain])
    delivery = _flags(configs["multiplex-graph-floor-guarded-delivery-itl60"])
    guarded = _flags(configs["multiplex-graph-floor-guarded-itl60"])
    assert delivery.pop("--mux-prefill-correction") == "delivery"
    assert guarded.pop("--mux-prefill-correction") == "compounding"
    assert delivery == guarded
    banked = _flags(configs["multiplex-graph-floor-bank3-guarded-delivery-itl60"])
    unbanked = _flags(configs["multiplex-graph-floor-guarded-delivery-itl60"])
    assert (banked.pop("--mux-tpot-bank-cap"), unbanked.pop("--mux-tpot-bank-cap")) == ("3", "0")
    assert banked == unbanked
    off_graphs = _flags(configs["multiplex-graph-floor-off-graphs-itl60"])
    assert off_graphs.pop("--mux-floor-off-graphs") == "on"
    assert off_graphs == _flags(configs["multiplex-graph-floor-itl60"])
    temporal = _flags(configs["multiplex-temporal-graph-floor-itl60"])
    every_option = _flags(configs["multiplex-graph-floor-itl60"])
    assert temporal.pop("--mux-sharing") == "temporal"
    assert every_option.pop("--mux-sharing") == "temporal,time_slice,spatial"
    assert temporal == every_option
    default = _flags(configs["multiplex-graph512-floor-converging-noslice-itl60"])
    assert (default.pop("--mux-sharing"), default.pop("--mux-prefill-correction")) == (
        "temporal,spatial", "converging")
    earlier = _flags(configs["multiplex-graph512-floor-itl60"])
    assert (earlier.pop("--mux-sharing"), earlier.pop("--mux-prefill-correction")) == (
        "temporal,time_slice,spatial", "compounding")
    assert default == earlier


def test_every_multiplex_config_names_its_graph_steps_and_floor():
    """The engine's defaults for both changed; a config's records must keep one meaning."""
    configs = _load("goodput_h200").CONFIGS
    for name, args in configs.items():
        if "--schedule multiplex" in args:
            flags = _flags(args.replace("{predictor}", "p").replace("{ttft_slo_ms}", "1"))
            assert "--mux-graph-step-tokens" in flags and "--mux-mixed-floor-tokens" in flags, name
            assert "--mux-sharing" in flags and "--mux-prefill-correction" in flags, name


def test_every_config_names_its_prefill_step_graphs():
    """The graphs' default size changed (256 -> 512 tokens); a config's records must keep
    one meaning, and the graph512 pair must differ from its 256 forms only by the graphs."""
    configs = _load("goodput_h200").CONFIGS
    sizes = {name: _flags(args)["--piecewise-graph-max-tokens"] for name, args in configs.items()}
    wide = {name for name, size in sizes.items() if size == "512"}
    assert wide == {name for name in configs if "graph512" in name}
    assert {"multiplex-graph512-floor-itl60", "chunk512-graph512"} <= wide
    assert set(sizes.values()) == {"256", "512"}
    for wide, narrow in [("multiplex-graph512-floor-itl60", "multiplex-graph-floor-itl60"),
                         ("multiplex-graph512-floor-bank3-itl60",
                          "multiplex-graph-floor-bank3-itl60"),
                         ("multiplex-graph512-floor-pressed-itl60",
                          "multiplex-graph-floor-pressed-itl60"),
                         ("multiplex-graph512-floor-converging-itl60",
                          "multiplex-graph-floor-converging-itl60"),
                         ("multiplex-temporal-graph512-floor-itl60",
                          "multiplex-temporal-graph-floor-itl60"),
                         ("chunk512-graph512", "chunk512")]:
        wide_flags, narrow_flags = _flags(configs[wide]), _flags(configs[narrow])
        for flags, size in ((wide_flags, "512"), (narrow_flags, "256")):
            assert flags.pop("--piecewise-graph-max-tokens") == size
            assert flags.pop("--mux-graph-step-tokens", size) == size
        assert wide_flags == narrow_flags


def test_definitions_cover_the_issue():
    module = _load("goodput_h200")
    assert set(module.TABLE_CONFIGS) <= set(module.CONFIGS)
    assert {module.WORKLOADS[w].ttft_slo_ms for w in ("loogle", "sharegpt", "mooncake")} == {
        15000.0, 2000.0, 5000.0}
    loogle = module.WORKLOADS["loogle"].build_spec(0.3, module.TRACE).build()
    assert len(loogle) == 27 and {r.output_len for r in loogle} == {64}
    assert 12000 <= min(r.prompt_len for r in loogle) <= max(r.prompt_len for r in loogle) <= 20000
    trace = module.WORKLOADS["mooncake"].build_spec(0.5, module.TRACE)
    requests = trace.build()
    assert len(requests) == 45 and max(r.prompt_len + r.output_len for r in requests) <= 24576
    offsets = trace.offsets(requests, 0.5)
    assert offsets[-1] == pytest.approx(44 / 0.5)  # the 10-minute window squeezed to 0.5 req/s


# --- the summary, on records whose answers are known ------------------------------------------

def _record(tool, workload: str, config: str, rate: float, share: float, revision: str,
            created: str, tpot_ms: float = 30.0, requests: int | None = None) -> dict:
    """``share`` of the requests within every SLO (TTFT 1 s, TPOT ``tpot_ms``), the rest
    failed; as many requests as the workload's definition sends at ``rate`` unless told."""
    n = tool.expected_requests(workload, rate) if requests is None else requests
    met = round(share * n)
    ok = {"success": True, "ttft_ms": 1000.0, "tpot_ms": tpot_ms}
    bad = {"success": False, "ttft_ms": None, "tpot_ms": None}
    return {"created": created, "git_revision": revision,
            "probe": {"workload": workload, "config": config, "rate": rate},
            "samples": [ok] * met + [bad] * (n - met)}


def _write(tool, folder, record: dict) -> None:
    probe = record["probe"]
    tool.write_json(record, tool.probe_path(folder, probe["workload"], probe["config"],
                                            probe["rate"]))


def test_summary_brackets_missing_probes_revisions_and_figure3(tool, tmp_path):
    rev_a, rev_b = "a" * 40, "b" * 40
    for rate, met in ((0.2, 1.0), (0.4, 0.5)):  # 0.3 not probed yet
        _write(tool, tmp_path, _record(tool, "loogle", "multiplex-itl60", rate, met, rev_a, "2"))
    for rate, met in ((0.1, 1.0), (0.15, 0.8)):  # adjacent rungs: settled at 0.1
        _write(tool, tmp_path, _record(tool, "loogle", "chunk512", rate, met, rev_a, "2"))
    _write(tool, tmp_path, _record(tool, "loogle", "chunk1024", 0.3, 1.0, rev_b, "1"))
    # An older record of the same probe loses to the newer one.
    older = _record(tool, "loogle", "chunk2048", 0.3, 0.0, rev_b, "1")
    tool.write_json(older, tmp_path / "old_copy.json")
    _write(tool, tmp_path, _record(tool, "loogle", "chunk2048", 0.3, 1.0, rev_a, "3"))

    data = tool.summarise(tmp_path, tmp_path, ["loogle"])
    by_key = {(s["workload"], s["config"], s["tpot_slo_ms"]): s for s in data["searches"]}
    mux = by_key[("loogle", "multiplex-itl60", 60.0)]
    assert (mux["goodput_rps"], mux["lowest_failing_rps"], mux["next_rate"]) == (0.2, 0.4, 0.3)
    chunk = by_key[("loogle", "chunk512", 60.0)]
    assert chunk["finished"] and chunk["goodput_rps"] == 0.1
    assert by_key[("loogle", "chunk2048", 60.0)]["curve"] == [(0.3, 1.0)]  # the newer one
    missing = {(m["workload"], m["config"], m["rate"]) for m in data["missing"]}
    assert ("loogle", "multiplex-itl60", 0.3) in missing
    assert ("loogle", "chunk1024", 0.6) in missing  # passed at 0.3: double it
    assert ("sharegpt", "disagg", 6.0) in missing  # never probed: the start rate

    markdown = (tmp_path / "summary.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| multiplex-itl60 |"))
    assert "between 0.2 and 0.4 (searching)" in row and "†" not in row
    assert next(line for line in markdown.splitlines()
                if line.startswith("| chunk512 |")).split("|")[2].strip() == "0.1"
    assert "† (bbbbbbb)" in markdown  # chunk1024 comes from another revision
    assert "run --search loogle:multiplex-graph512-floor-converging-noslice-reweigh-bank200q5-" \
        "pressed105-corun130-itl60,multiplex-graph512-floor-converging-noslice-itl60 " \
        "--max-probes 2" in markdown
    assert (tmp_path / "figure3_loogle.png").stat().st_size > 0
    assert "| chunk512 | 0.1 | 0.1 | 0.1 | 0.1 |" in markdown  # one run, every ITL SLO


def test_chunked_probes_serve_every_figure3_slo(tool, tmp_path):
    # TPOT 70 ms: within 80 and 100, not 40 or 60.
    _write(tool, tmp_path, _record(tool, "loogle", "chunk256", 0.3, 1.0, "c" * 40, "1", 70.0))
    data = tool.summarise(tmp_path, tmp_path, ["loogle"])
    goodput = {s["tpot_slo_ms"]: s["goodput_rps"] for s in data["searches"]
               if s["config"] == "chunk256"}
    assert goodput == {40.0: 0.0, 60.0: 0.0, 80.0: 0.3, 100.0: 0.3}


def test_a_failure_off_the_probe_definition_is_probed_again(tool, tmp_path):
    # 0.45 passed as defined; 0.5 (the next rung) failed in a 40-request run (the definition
    # sends 30 there): the bracket stands but is marked, and 0.5 is asked for again.
    _write(tool, tmp_path, _record(tool, "loogle", "multiplex-itl60", 0.45, 1.0, "a" * 40, "2"))
    _write(tool, tmp_path, _record(tool, "loogle", "multiplex-itl60", 0.5, 0.2, "b" * 40, "1",
                                   requests=40))
    _write(tool, tmp_path, _record(tool, "loogle", "chunk256", 0.45, 1.0, "a" * 40, "2"))
    _write(tool, tmp_path, _record(tool, "loogle", "chunk256", 0.5, 0.2, "a" * 40, "2"))
    data = tool.summarise(tmp_path, tmp_path, ["loogle"])
    mux = next(s for s in data["searches"]
               if s["config"] == "multiplex-itl60" and s["tpot_slo_ms"] == 60.0)
    assert (mux["goodput_rps"], mux["lowest_failing_rps"]) == (0.45, 0.5)
    assert mux["off_definition_requests"] == {"0.5": 40}
    missing = {(m["workload"], m["config"], m["rate"]) for m in data["missing"]}
    assert ("loogle", "multiplex-itl60", 0.5) in missing
    assert not {m for m in missing if m[:2] == ("loogle", "chunk256") and m[2] <= 0.5}
    markdown = (tmp_path / "summary.md").read_text()
    assert "0.5: 20% (40 requests)" in markdown and "| re-probe 0.5 |" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| multiplex-itl60 |"))
    assert "‡" in row
    chunk_row = next(line for line in markdown.splitlines() if line.startswith("| chunk256 |"))
    assert "‡" not in chunk_row
    # An explicit --probe of it runs again; one recorded as defined does not.
    run = _config_run(tool, tmp_path)
    assert tool.next_probe(tool.Target("loogle", "multiplex-itl60", 0.5), run) == 0.5
    assert tool.next_probe(tool.Target("loogle", "chunk256", 0.5), run) is None


def _config_run(tool, results: Path, out: Path | None = None):
    opts = tool.RunOptions(results, Path("trace"), Path("predictor"), "tiny", "", 0, 0.0, 2,
                           tool.Budget(0.0), out=out)
    return SimpleNamespace(opts=opts, done=0)


def test_a_device_call_reads_the_repository_records_and_writes_elsewhere(tool, tmp_path):
    repo, device = tmp_path / "repo", tmp_path / "device"
    device.mkdir()
    _write(tool, repo, _record(tool, "loogle", "chunk256", 0.3, 1.0, "a" * 40, "1"))
    run = _config_run(tool, repo, device)
    assert run.opts.written() == device
    # Recorded in the repository: skipped; the search goes on from it (0.3 passed: 0.6).
    assert tool.next_probe(tool.Target("loogle", "chunk256", 0.3), run) is None
    assert tool.next_probe(tool.Target("loogle", "chunk256"), run) == 0.6
    # Recorded in the call's output folder earlier in the call: the search moves on again.
    _write(tool, device, _record(tool, "loogle", "chunk256", 0.6, 0.0, "a" * 40, "2"))
    assert tool.next_probe(tool.Target("loogle", "chunk256", 0.6), run) is None
    assert tool.next_probe(tool.Target("loogle", "chunk256"), run) == 0.45


STANDIN = Path(__file__).resolve().parents[1] / "bench" / "bench_standin.py"


def _quick(tool, monkeypatch) -> None:
    quick = tool.ProbeWorkload("quick", "random:input_len=8,output_len=2,vocab_size=256",
                               ttft_slo_ms=60_000.0, span_s=0.01, min_requests=3,
                               max_requests=3, drain_s=0.1, ladder=(100.0,), start_rate=100.0)
    monkeypatch.setitem(tool.WORKLOADS, "quick", quick)
    monkeypatch.setitem(tool.CONFIGS, "slow", "--prefill-ms 3000")


@pytest.mark.slow
def test_a_probe_that_overruns_the_budget_is_cut_and_writes_nothing(tool, tmp_path,
                                                                     monkeypatch, capsys):
    # The stand-in prefills one request at a time, 3 s each: warm-up and probe need >= 15 s.
    # The drain allowance (0.1 s) lets the probe start; the budget leaves it < 7 s (the
    # budget less the 15 s kept for stopping, less the stand-in's start).
    _quick(tool, monkeypatch)
    command = f"{shlex.quote(sys.executable)} {STANDIN} --host 127.0.0.1 --port {{port}}"
    code = tool.main(["run", "--probe", "quick:slow:100", "--model", "standin",
                      "--server-args", "", "--server-cmd", command, "--startup-s", "3",
                      "--budget-s", "22", "--results", str(tmp_path),
                      "--port", str(_free_port())])
    assert code == 0
    assert "quick:slow:100 cut at the budget limit; nothing written" in capsys.readouterr().out
    assert not load_records(tmp_path)


def test_a_server_that_never_comes_up_fails_the_call(tool, tmp_path, monkeypatch, capsys):
    _quick(tool, monkeypatch)
    code = tool.main(["run", "--probe", "quick:slow:100", "--server-args", "",
                      "--server-cmd", "false {model} {port}", "--startup-s", "3",
                      "--budget-s", "60",
                      "--results", str(tmp_path), "--port", str(_free_port())])
    assert code == 1
    assert "slow: server not up: server exited with 1" in capsys.readouterr().out
    assert not load_records(tmp_path)


def test_imported_records_give_the_attainment_their_runs_reported(tool, tmp_path):
    # The figures these runs reported: multiplex 92.5% at 0.3 req/s (4f22d08) and 17.5% at
    # 0.5 (6f90be1, the newest run of that probe), chunk 512 at 36d9d59 45% at 0.3, 0% at
    # 0.5 (TTFT 15 s, TPOT 60 ms).
    written = tool.import_legacy(tmp_path)
    probes = {entry[:2] for entry in tool.LEGACY_LOOGLE.values()}  # newest run of each
    assert len(written) == len(probes) + 4
    assert tool.import_legacy(tmp_path) == []  # never overwrites
    data = tool.summarise(tmp_path, tmp_path, ["loogle"])
    curves = {(s["workload"], s["config"], s["tpot_slo_ms"]): s["curve"]
              for s in data["searches"]}
    assert curves[("loogle", "multiplex-itl60", 60.0)] == [(0.3, 0.925), (0.5, 0.175)]
    assert curves[("loogle", "chunk512", 60.0)] == [(0.3, 0.45), (0.5, 0.0)]
    assert [rate for rate, _ in curves[("sharegpt", "chunk2048", 60.0)]] == [6.0]
    records = {r["probe"]["config"]: r for r in load_records(tmp_path)
               if r["probe"]["workload"] == "loogle"}
    assert records["multiplex-itl60"]["predictor"]["sha256"]
    assert records["chunk512"]["git_revision"] == "36d9d59"
    assert records["multiplex-itl60"]["git_revision"] in ("4f22d08", "6f90be1")


def test_a_probed_variant_gets_a_row_and_a_search_of_its_own(tool, tmp_path):
    _write(tool, tmp_path, _record(tool, "loogle", "multiplex-graph-itl60", 0.5, 1.0,
                                   "a" * 40, "1"))
    _write(tool, tmp_path, _record(tool, "loogle", "chunk256", 0.5, 1.0, "a" * 40, "1"))
    data = tool.summarise(tmp_path, tmp_path, [])
    graph = [s for s in data["searches"] if s["config"] == "multiplex-graph-itl60"]
    assert [(s["workload"], s["goodput_rps"]) for s in graph if s["curve"]] == [("loogle", 0.5)]
    rows = [line for line in (tmp_path / "summary.md").read_text().splitlines()
            if line.startswith("| multiplex-graph-itl60 |")]
    assert len(rows) == 1 and ">= 0.5" in rows[0]
    # A variant nobody probed stays out of the table.
    assert "| multiplex-temporal-itl60 |" not in (tmp_path / "summary.md").read_text()


def test_a_multiplex_probe_keeps_its_timeline_and_what_the_engine_learned(tool, tmp_path):
    import gzip
    import json

    entries = [{"mode": "temporal", "decode_batch": 2}, {"mode": "spatial", "decode_batch": 3}]
    result = {"samples": [], "engine_timeline": entries,
              "engine_after": {"calibration": {"mixed_steps": 1.2}, "prefill_order_reorders": 9,
                               "kernels_compiled_while_serving": {"watched": True,
                                                                  "compiles": 0}},
              "slo_attainment": 1.0}
    run = SimpleNamespace(backend=SimpleNamespace(engine_info={"partitions": None,
                                                               "prefill_order": "slo"}),
                          server=SimpleNamespace(command="pdserve serve"), config="chunk16",
                          served=2,
                          args="--schedule chunked --chunk-size 16",
                          opts=SimpleNamespace(predictor=tmp_path / "none.json"))
    spec = tool.WORKLOADS["tiny"].build_spec(4.0, tmp_path)
    record = tool.probe_record(run, spec, [], 4.0, result)
    assert record["calibration_after"] == {"mixed_steps": 1.2}
    assert record["compiled_while_serving"] == {"watched": True, "compiles": 0}
    assert record["server"] == {"probes_before": 2, "fresh_per_probe": False}
    assert record["prefill_order"] == {"prefill_order": "slo", "prefill_order_reorders": 9,
                                       "prefill_order_rate_tokens_per_s": None}
    assert record["engine_modes"] == {"temporal": 1, "spatial": 1}
    assert "engine_after" not in record["summary"]
    path = tmp_path / "loogle__multiplex-itl60__r0.5.json"
    tool.write_timeline(entries, path)
    with gzip.open(tmp_path / "loogle__multiplex-itl60__r0.5_timeline.json.gz", "rt") as f:
        assert json.load(f) == entries
    assert load_records(tmp_path) == []  # a timeline is not a probe record


def test_a_probe_records_the_trace_by_its_path_in_the_repository(tool, tmp_path):
    """The default trace is an absolute path on whichever machine ran the probe."""
    assert tool.repo_relative(str(tool.TRACE)) == (
        "benchmarks/data/mooncake_conversation_trace.jsonl")
    outside = str(tmp_path / "trace.jsonl")
    assert tool.repo_relative(outside) == outside
    assert tool.repo_relative("benchmarks/data/x.jsonl") == "benchmarks/data/x.jsonl"
    assert tool.repo_relative(None) is None
    run = SimpleNamespace(backend=SimpleNamespace(engine_info={}), config="chunk16",
                          server=SimpleNamespace(command="pdserve serve"), served=0,
                          args="--schedule chunked --chunk-size 16",
                          opts=SimpleNamespace(predictor=None))
    spec = tool.WORKLOADS["mooncake"].build_spec(0.3, tool.TRACE)
    record = tool.probe_record(run, spec, [], 0.3, {"samples": [], "slo_attainment": 1.0})
    assert record["workload"]["path"] == "benchmarks/data/mooncake_conversation_trace.jsonl"


def test_a_repeat_runs_a_recorded_probe_again_into_a_file_of_its_own(tool, tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    _write(tool, results, _record(tool, "loogle", "chunk256", 0.5, 1.0, "a" * 40, "1"))
    opts = SimpleNamespace(folders=lambda: [results, out], written=lambda: out, repeat=False)
    run = SimpleNamespace(opts=opts, done=0)
    target = tool.Target("loogle", "chunk256", 0.5)
    assert tool.next_probe(target, run) is None  # recorded: skipped without --repeat
    opts.repeat = True
    assert tool.next_probe(target, run) == 0.5
    first = tool.record_path(opts, "loogle", "chunk256", 0.5)
    assert first == out / "loogle__chunk256__r0.5__rep2.json"
    out.mkdir()
    first.write_text("{}")
    assert tool.record_path(opts, "loogle", "chunk256", 0.5).name == \
        "loogle__chunk256__r0.5__rep3.json"
    # A probe never recorded keeps its own name under --repeat.
    assert tool.record_path(opts, "loogle", "chunk512", 0.2) == out / "loogle__chunk512__r0.2.json"
    with pytest.raises(SystemExit, match="--repeat repeats --probe"):
        tool.main(["run", "--search", "loogle:chunk256", "--repeat", "--budget-s", "10",
                   "--results", str(results)])


def test_a_device_call_is_imported_with_repeats_renamed_and_its_output_path_portable(
        tool, tmp_path):
    results, out = tmp_path / "results", tmp_path / "device" / "out" / "goodput"
    (out / "logs").mkdir(parents=True)
    results.mkdir()
    command = ["benchmarks/goodput_h200.py", "run", "--out", str(out)]
    for name, created in (("sharegpt__chunk512__r16", "1"), ("sharegpt__chunk512__r16__rep2", "2"),
                          ("loogle__chunk256__r0.6", "3")):
        record = _record(tool, name.split("__")[0], name.split("__")[1],
                         16.0 if "sharegpt" in name else 0.6, 1.0, "c" * 40, created)
        record["command"] = command
        (out / f"{name}.json").write_text(json.dumps(record))
        tool.write_timeline([{"created": created}], out / f"{name}.json")
        (out / "logs" / f"{name}.log").write_text(f"server {created}")
    # The results already hold both ShareGPT-like names (an earlier call at this revision).
    for name in ("sharegpt__chunk512__r16", "sharegpt__chunk512__r16__rep2"):
        (results / f"{name}.json").write_text("{}")

    tool.main(["import-call", str(out), "--label", "call2", "--results", str(results)])
    for name, created in (("sharegpt__chunk512__r16__rep3", "1"),
                          ("sharegpt__chunk512__r16__rep4", "2"), ("loogle__chunk256__r0.6", "3")):
        record = json.loads((results / f"{name}.json").read_text())
        assert record["created"] == created
        assert record["command"][-1] == "$OUT/goodput"
        assert str(tmp_path) not in (results / f"{name}.json").read_text()
        assert tool.load_engine_timeline(tool.timeline_beside(results / f"{name}.json")) == [
            {"created": created}]
        log = results / "server_logs_ccccccc" / f"call2_{name}.log"
        assert log.read_text() == f"server {created}"
    assert (results / "sharegpt__chunk512__r16.json").read_text() == "{}"


def test_every_run_of_a_repeated_probe_is_listed_and_the_newest_decides(tool, tmp_path):
    _write(tool, tmp_path, _record(tool, "loogle", "multiplex-itl60", 0.5, 1.0, "a" * 40, "1"))
    repeat = _record(tool, "loogle", "multiplex-itl60", 0.5, 0.5, "b" * 40, "2")
    repeat["environment_variables"] = {"CUDA_MODULE_LOADING": "EAGER"}  # an A/B's other arm
    tool.write_json(repeat, tmp_path / "loogle__multiplex-itl60__r0.5__rep2.json")
    data = tool.summarise(tmp_path, tmp_path, [])
    mux = next(s for s in data["searches"]
               if s["config"] == "multiplex-itl60" and s["tpot_slo_ms"] == 60.0)
    assert mux["curve"] == [(0.5, 0.5)]  # the newer run
    markdown = (tmp_path / "summary.md").read_text()
    assert ("| loogle | multiplex-itl60 | 0.5 | 100% (aaaaaaa), "
            "50% (bbbbbbb, CUDA_MODULE_LOADING=EAGER) |") in markdown


def test_the_slo_order_configs_take_each_workload_s_ttft_slo():
    module = _load("goodput_h200")
    predictor = module.ROOT / "none.json"
    for name, base in (("chunk256-slo", "chunk256"),
                       ("multiplex-graph-floor-slo-itl60", "multiplex-graph-floor-itl60")):
        args = module.config_args(name, predictor, "mooncake")
        assert _flags(args) == {**_flags(module.config_args(base, predictor, None)),
                                "--ttft-slo-ms": "5000", "--prefill-order": "slo"}
        assert "--ttft-slo-ms 15000" in module.config_args(name, predictor, "loogle")
        with pytest.raises(ValueError, match="TTFT SLO"):
            module.config_args(name, predictor, None)
    targets = [module.Target(w, "chunk256-slo") for w in ("mooncake", "loogle", "mooncake")] \
        + [module.Target(w, "chunk256") for w in ("mooncake", "loogle")]
    groups = module.by_config(targets)
    assert list(groups) == [("chunk256-slo", "mooncake"), ("chunk256-slo", "loogle"),
                            ("chunk256", None)]
    assert len(groups[("chunk256-slo", "mooncake")]) == 2


def test_a_probe_with_its_own_itl_target_reports_attainment_at_that_target_too(tool):
    # 70 ms per token: misses the workloads' TPOT 60 ms, meets multiplex-itl80's own target.
    samples = [{"success": True, "ttft_ms": 1000.0, "tpot_ms": 70.0}] * 3
    result = {"slo_attainment": 0.0, "samples": samples}
    line = tool.attainment_line(result, 15_000.0, "multiplex-itl80")
    assert line == "attainment 0.000 (TPOT 60 ms), 1.000 at TPOT 80 ms"
    assert tool.attainment_line(result, 15_000.0, "multiplex-itl60") == "attainment 0.000"
    assert tool.attainment_line(result, 15_000.0, "chunk256") == "attainment 0.000"


def test_the_pressed_configs_are_valid_server_flags_with_each_workload_s_ttft_slo():
    """Each pressed config adds the pressure and its workload's TTFT SLO to its base, and
    the engine's own config accepts the result."""
    from pdserve.config import SchedulerConfig

    module = _load("goodput_h200")
    predictor = module.ROOT / "none.json"
    for name, base in (("multiplex-graph-floor-pressed-itl60", "multiplex-graph-floor-itl60"),
                       ("multiplex-graph-floor-bank3-pressed-itl60",
                        "multiplex-graph-floor-bank3-itl60")):
        args = module.config_args(name, predictor, "sharegpt")
        assert _flags(args) == {**_flags(module.config_args(base, predictor, None)),
                                "--ttft-slo-ms": "2000", "--mux-ttft-pressed-margin": "1"}
        flags = _flags(args)
        config = SchedulerConfig(itl_slo_ms=float(flags["--itl-slo-ms"]),
                                 ttft_slo_ms=float(flags["--ttft-slo-ms"]),
                                 mux_ttft_pressed_margin=float(
                                     flags["--mux-ttft-pressed-margin"]))
        assert config.mux_ttft_pressed_margin == 1.0


def _call_record(tool, config: str, rate: float, created: str, **extra) -> dict:
    record = _record(tool, "sharegpt", config, rate, 1.0, "a" * 40, created)
    return {**record, "command": ["benchmarks/goodput_h200.py", "run", "--probe", "x"], **extra}


def test_probes_that_inherited_a_multiplex_server_s_learning_are_named(tool, tmp_path):
    mux = "multiplex-graph-floor-itl60"
    first = _call_record(tool, mux, 20.0, "2026-12-03T12:00:00+00:00")
    inherited = _call_record(tool, mux, 18.0, "2026-12-03T12:01:30+00:00")
    next_call = _call_record(tool, mux, 16.0, "2026-12-03T13:00:00+00:00")  # another call
    fresh = _call_record(tool, mux, 24.0, "2026-12-03T13:02:00+00:00",
                         server={"probes_before": 0, "fresh_per_probe": True})
    chunked = [_call_record(tool, "chunk512", r, f"2026-12-03T12:0{i}:00+00:00")
               for i, r in enumerate((12.0, 14.0))]  # no learned state: not listed
    records = [first, inherited, next_call, fresh, *chunked]
    before = {r["probe"]["rate"]: [b["probe"]["rate"] for b in earlier]
              for r, earlier in tool.probes_before_on_server(records)}
    assert before == {20.0: [], 18.0: [20.0], 16.0: [], 24.0: []}
    for record in records:
        _write(tool, tmp_path, record)
    tool.summarise(tmp_path, tmp_path, [])
    markdown = (tmp_path / "summary.md").read_text()
    assert "| sharegpt | multiplex-graph-floor-itl60 | 18 | 100% | aaaaaaa | sharegpt 20 |" \
        in markdown
    assert markdown.count("| sharegpt | multiplex-graph-floor-itl60 |") == 2  # + its search


def test_a_multiplex_server_is_stopped_after_each_probe_and_a_chunked_one_serves_on(tool):
    import asyncio

    stopped = []
    opts = SimpleNamespace(predictor=Path("none.json"))
    for config in ("multiplex-graph-floor-itl60", "chunk512"):
        run = tool.ConfigRun(config, opts)
        run.server = SimpleNamespace(stop=lambda c=config: stopped.append(c))
        asyncio.run(run.probe_done())
        assert (run.server is None) == tool.learns_online(config)
        assert run.served == (0 if tool.learns_online(config) else 1)
    assert stopped == ["multiplex-graph-floor-itl60"]
    assert tool.learns_online("multiplex-itl60") and not tool.learns_online("disagg")


def test_figure3_shows_the_best_probed_multiplex_configuration_of_each_target(tool, tmp_path):
    _write(tool, tmp_path, _record(tool, "loogle", "multiplex-graph-itl60", 0.6, 1.0, "a" * 40,
                                   "1"))
    _write(tool, tmp_path, _record(tool, "loogle", "multiplex-itl60", 0.3, 0.5, "a" * 40, "2"))
    # A variant probed only on another workload gets an empty loogle search: not shown.
    _write(tool, tmp_path, _record(tool, "sharegpt", "multiplex-graph-floor-pressed-itl60", 16.0,
                                   1.0, "a" * 40, "3"))
    tool.summarise(tmp_path, tmp_path, ["loogle"])
    markdown = (tmp_path / "summary.md").read_text()
    row = next(line for line in markdown.splitlines() if line.startswith("| multiplex | "))
    assert row.split("|")[3].strip() == ">= 0.6 (multiplex-graph-itl60)"


def test_the_itl_budget_a_multiplex_probe_used_is_summarised(tool, tmp_path):
    # Ten sharing steps at 30..57 ms against a 60 ms target, three decode-only steps.
    # Two of them spatial decisions 4.5 s apart.
    timeline = [{"mode": "temporal", "measured_cycle_ms": 30.0 + 3 * i, "time": 100.0 + i}
                for i in range(10)]
    timeline[2]["mode"], timeline[7]["mode"], timeline[7]["time"] = "spatial", "spatial", 106.5
    timeline += [{"mode": "decode_only", "measured_cycle_ms": 20.0, "time": 120.0}] * 3
    use = tool.budget_use(timeline, 60.0)
    assert use == {"sharing_steps": 10, "p10": 0.55, "p50": 0.75, "p90": 0.95,
                   "decode_only_steps": 3, "spatial_decisions": 2, "spatial_span_s": 4.5}
    assert tool.budget_use(timeline[10:], 60.0) is None  # nothing prefilled
    record = _record(tool, "sharegpt", "multiplex-graph-floor-itl60", 16.0, 1.0, "a" * 40, "1")
    path = tmp_path / "sharegpt__multiplex-graph-floor-itl60__r16__rep2.json"
    tool.write_json(record, path)
    tool.write_timeline(timeline, path)
    _write(tool, tmp_path, _record(tool, "sharegpt", "chunk512", 16.0, 1.0, "a" * 40, "1"))
    assert tool.budget_use_lines(tmp_path)[-1] == (
        "| sharegpt | multiplex-graph-floor-itl60 | 16 (run 2) | 100% | 10 | 0.55 / 0.75 / 0.95 "
        "| 3 | 2 over 4.5 s |")


def test_every_config_is_a_serve_command_line_the_cli_accepts():
    """A typo in a config would only show on the GPU, as a server that never starts."""
    import shlex
    from pathlib import Path

    from pdserve.cli import build_parser
    from pdserve.sim.mux_steps import scheduler_config

    tool = _load("goodput_h200")
    parser = build_parser()
    for config in tool.CONFIGS:
        args = tool.config_args(config, Path("predictor.json"), "sharegpt")
        parsed = parser.parse_args(["serve", "codellama-34b", *shlex.split(args)])
        assert parsed.command == "serve", config
        scheduler_config(args)  # and the values pass the scheduler's own checks


def test_probes_stop_before_any_server_on_a_gpu_they_are_not_for(tool):
    from pdserve.bench.report import check_gpu

    assert tool.check_gpu is check_gpu  # what cmd_run calls before any server
    with pytest.raises(SystemExit, match="NVIDIA H100 80GB HBM3.*not an H200"):
        check_gpu("H200", lambda: "NVIDIA H100 80GB HBM3")
    check_gpu("H200", lambda: "NVIDIA H200")
    check_gpu("H200", lambda: None)  # no nvidia-smi: a CPU host, the tiny model's runs
    check_gpu("any", lambda: "NVIDIA H100 80GB HBM3")
    from pdserve.bench.report import expected_gpu

    assert (expected_gpu(None, "codellama-34b"), expected_gpu(None, "tiny")) == ("H200", "any")
    assert expected_gpu("H100", "codellama-34b") == "H100"
