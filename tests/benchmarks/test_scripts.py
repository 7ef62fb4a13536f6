"""The benchmark scripts' own logic (their GPU runs are not for CI)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import pytest

from pdserve.model.arch import PRESETS
from pdserve.ops.dispatch import triton_available

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_baseline_configs_include_the_schedules_it_compares():
    baseline = _load("run_baseline")
    args = argparse.Namespace(smoke=False, configs="chunk512,multiplex,disagg",
                              model="codellama-34b", port=8100, out="cmp.json",
                              server_args=None)
    argv = baseline.build_argv(args)
    configs = [argv[i + 1] for i, a in enumerate(argv) if a == "--config"]
    assert configs == ["chunk512=--schedule chunked --chunk-size 512",
                       f"multiplex={baseline.CONFIGS['multiplex']}",
                       f"disagg={baseline.CONFIGS['disagg']}"]
    assert "--schedule multiplex" in baseline.CONFIGS["multiplex"]
    with pytest.raises(SystemExit, match="unknown config"):
        baseline.build_argv(argparse.Namespace(**{**vars(args), "configs": "chunk7"}))


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.ops.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.ops.test_a" name="test_bad" time="0.25"><failure message="x"/></testcase>
<testcase classname="tests.server.test_e2e" name="test_skip" time="0">
<skipped message="no"/></testcase>
</testsuite></testsuites>"""


def test_gpu_test_record_keeps_every_case_and_outcome(tmp_path, monkeypatch):
    record = _load("record_gpu_tests")
    xml, out = tmp_path / "report.xml", tmp_path / "gpu_tests.json"
    xml.write_text(JUNIT)
    out.write_text(json.dumps({"device": "NVIDIA H200", "runs": []}))
    monkeypatch.setattr(sys, "argv", ["record_gpu_tests.py", str(xml), "--revision", "abc",
                                      "--command", "pytest -m gpu", "--record", str(out)])
    assert record.main() == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["git_revision"] == "abc"
    assert [(c["test"], c["outcome"]) for c in run["cases"]] == [
        ("tests.ops.test_a::test_ok", "passed"), ("tests.ops.test_a::test_bad", "failed"),
        ("tests.server.test_e2e::test_skip", "skipped")]
    assert run["summary"].startswith("1 failed, 1 passed, 1 skipped")


def test_loogle_timeline_summary_splits_time_and_cycles_by_mode():
    loogle = _load("loogle_h200")
    entry = lambda t, mode, measured, predicted, sms=132: {
        "time": t, "mode": mode, "measured_cycle_ms": measured, "predicted_cycle_ms": predicted,
        "decode_sms": sms}
    entries = [entry(0.0, "warm-up", 0, 0), entry(10.0, "spatial", 30.0, 40.0, 24),
               entry(10.5, "temporal", 54.0, 50.0), entry(11.0, "spatial", 36.0, 40.0, 16),
               entry(12.0, "decode_only", 0, 20.0)]
    summary = loogle.summarise_timeline(entries, since=5.0, itl_ms=60.0)
    assert summary["decisions"] == 4
    assert summary["seconds_by_mode"] == {"spatial": 1.5, "temporal": 0.5}
    spatial = summary["decode_cycle"]["spatial"]
    assert spatial["n"] == 2 and spatial["cycle_over_itl_p50"] == pytest.approx(0.55)
    assert spatial["measured_over_predicted_p50"] == pytest.approx(0.825)
    assert spatial["calibration_p50"] == spatial["calibration_last"] == 1.0
    assert "decode_only" not in summary["decode_cycle"]  # never measured
    assert summary["spatial_decode_sms"] == {"16": 1, "24": 1}


def test_loogle_aligned_multiplex_follows_the_defaults_and_parses():
    from pdserve.cli import build_parser, engine_config_from_args  # noqa: PLC0415
    loogle = _load("loogle_h200")
    aligned = loogle.CONFIGS["multiplex-aligned"]
    assert aligned == loogle.CONFIGS["multiplex"] + " --mux-align-step-tokens"
    config = engine_config_from_args(build_parser().parse_args(["serve", *aligned.split()]))
    assert config.scheduler.mux_align_step_tokens


def test_loogle_attainment_needs_both_slos():
    loogle = _load("loogle_h200")
    requests = [{"ok": True, "ttft": 14.0, "e2e": 14.0 + 63 * 0.059},  # meets both
                {"ok": True, "ttft": 16.0, "e2e": 16.5},  # TTFT too late
                {"ok": True, "ttft": 1.0, "e2e": 1.0 + 63 * 0.061},  # TPOT too slow
                {"ok": False, "ttft": 0.0, "e2e": 0.0}]
    assert loogle.attainment(requests, output_len=64) == 0.25


def test_fleet_plot_labels_name_the_multiplexing_model():
    plots = _load("plot_sim_fleet")
    assert plots.label({"multiplex": False, "dynamic": False}) == "pure P/D"
    assert plots.label({"multiplex": True, "dynamic": False, "multiplex_model": "planner"}) \
        == "PD-multiplexing instances (planner model)"
    assert plots.label({"multiplex": True, "dynamic": False}) == \
        "PD-multiplexing instances (fixed model)"
    assert plots.label({"dynamic": True}) == "dynamic ratio"


def test_validation_plot_draws_measured_beside_each_simulation(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _load("plot_sim_fleet")
    sides = {side: {"p50": 0.1, "p99": 0.3} for side in plots.SIDES}
    run = {"compare": {"ttft_s": sides, "tpot_s": sides}}
    for name, result in (("group", {"kind": "validation", **run}),
                         ("instance", {"kind": "validation",
                                       "schedules": {"chunk512": run, "multiplex": run}})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        out = plots.plot(path, tmp_path)
        assert out.name == f"{name}.png" and out.stat().st_size > 1000


def test_a_held_out_check_is_drawn_as_simulated_against_measured(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _load("plot_sim_fleet")
    committed = BENCHMARKS / "results" / "sim_goodput_probes_h200_8ccd9ac.json"
    path = tmp_path / committed.name
    path.write_text(committed.read_text())
    out = plots.plot(path, tmp_path)
    assert out.name == "sim_goodput_probes_h200_8ccd9ac.png" and out.stat().st_size > 1000


def test_mux_whatif_walks_a_prompt_with_every_sharing_set(tmp_path):
    """The planner over the H200 profile (rows committed from the 6f90be1 run): each sharing
    set prefills the prompt; a dearer mixed step (the online correction) never makes
    mixed steps alone faster; the full planner predicts at least 0.98x the best single
    option, including the cell where judging by one cycle left it 12% below spatial alone
    (decode batch 2, ITL 80 ms, correction 1.3); every planned cycle keeps the ITL budget."""
    from pdserve.sched.predictor import LatencyPredictor

    whatif = _load("mux_whatif")
    rows = Path(__file__).parents[1] / "data" / "h200_codellama34b_profile_rows_6f90be1.json"
    data = json.loads(rows.read_text())
    predictor = LatencyPredictor.fit(data["rows"], gpu_name=data["gpu"], model_name=data["model"],
                                     num_layers=data["num_layers"], total_sms=data["total_sms"])
    predictor.save(tmp_path / "predictor.json")
    out = tmp_path / "whatif.json"
    assert whatif.main(["--predictor", str(tmp_path / "predictor.json"), "--prompt-tokens",
                        "16000", "--decode-batches", "2", "--itl-ms", "60,80",
                        "--corrections", "1.0,1.3,1.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "prediction" and len(result["rows"]) == 2 * 3 * 4
    rate = {(r["itl_ms"], r["mixed_correction"], "+".join(r["sharing"])):
            r["prefill_tokens_per_s"] for r in result["rows"]}
    singles = ("temporal", "time_slice", "spatial")
    assert all(rate[itl, 1.5, "temporal"] < rate[itl, 1.0, "temporal"] for itl in (60.0, 80.0))
    for itl, correction in itertools.product((60.0, 80.0), (1.0, 1.3, 1.5)):
        assert all(rate[itl, correction, name] > 0 for name in singles)
        full = rate[itl, correction, "+".join(singles)]
        assert full >= 0.98 * max(rate[itl, correction, name] for name in singles)
    assert all(r["max_cycle_ms"] <= 0.9 * r["itl_ms"] for r in result["rows"])


LOOGLE = BENCHMARKS / "results" / "loogle_h200"


def test_planner_flags_and_learned_corrections_of_a_server_command():
    whatif = _load("mux_whatif")
    settings = whatif.settings_of("python -m pdserve serve m --schedule multiplex "
                                  "--itl-slo-ms 80 --mux-sharing spatial,temporal")
    assert (settings.itl_ms, settings.sharing, settings.max_prefill_tokens) == \
        (80.0, ("temporal", "spatial"), 8192)  # the server's own default budget
    learned = settings.learned({"mixed_steps": 1.1, "co_running_decode": 0.9,
                                "prefill_pieces": {"spatial:24": {"correction": 1.2,
                                                                  "pieces": 3}}})
    planner = learned.planner(_h200_predictor())
    assert planner.predictor.mixed_correction == 1.1
    assert planner.predictor.decode_correction == 0.9
    assert planner.predictor.prefill_corrections == {"spatial:24": 1.2}
    assert settings.learned(None) is settings
    with pytest.raises(ValueError, match="--mux-sharing"):
        whatif.settings_of("--mux-sharing spatal")


def test_graph_steps_and_floor_from_the_flags_else_the_engine_else_off():
    """The walk plans graph steps and the mixed-step floor as the server did: a flag it was
    given, else what its engine resolved (``auto``), else off (every run before those
    defaults); and with the graph steps' learned correction."""
    whatif = _load("mux_whatif")
    engine = {"graph_step_tokens": 256, "mixed_floor_tokens": 256}
    assert (whatif.settings_of("--schedule multiplex").graph_step_tokens,
            whatif.settings_of("--schedule multiplex").mixed_floor_tokens) == (0, 0)
    resolved = whatif.settings_of("--schedule multiplex", engine)
    assert (resolved.graph_step_tokens, resolved.mixed_floor_tokens) == (256, 256)
    named = whatif.settings_of("--mux-graph-step-tokens 0 --mux-mixed-floor-tokens 128", engine)
    assert (named.graph_step_tokens, named.mixed_floor_tokens) == (0, 128)
    planner = resolved.learned({"mixed_steps": 1.0, "graph_mixed_steps": 0.9,
                                "co_running_decode": 1.0}).planner(_h200_predictor())
    assert planner.config.graph_step_tokens == 256 and planner.config.mixed_floor_tokens == 256
    assert planner.predictor.graph_mixed_correction == 0.9
    with pytest.raises(ValueError, match="--mux-tpot-bank-cap 3: the walk does not model"):
        whatif.settings_of("--mux-tpot-bank-cap 3")


def test_reweigh_replay_finds_the_spatial_batches_a_run_started_beside_decode(tmp_path):
    """The ShareGPT-like 16 req/s run at fdd80df that attained 61%: 14 spatial batches
    started beside decode from 6 s on, all but the first while a split's option ran; the
    whole planner, weighing each against the option running before it, takes mixed steps
    for some of them (a prediction with the corrections the run had learned by its end)."""
    whatif = _load("mux_whatif")
    record = (BENCHMARKS / "results" / "goodput_h200" /
              "sharegpt__multiplex-graph512-floor-converging-noslice-itl60__r16__rep2.json")
    out = tmp_path / "reweigh.json"
    assert whatif.main(["--predictor", str(LOOGLE / "06d5640_predictor.json"),
                        "--reweigh-replay", str(record), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"][str(record)]
    rows = run["batch_starts"]
    assert result["kind"] == "prediction" and len(rows) == 14
    assert all(r["ran"].startswith("spatial") and r["decode_batch"] > 0 for r in rows)
    assert all(r["running_before"].startswith("spatial") for r in rows[1:])
    assert 1 <= run["another_option_wins"] < len(rows)
    assert run["another_option_wins"] == sum(r["reweighed"] == "temporal" for r in rows)


def _h200_predictor():
    from pdserve.sched.predictor import LatencyPredictor

    return LatencyPredictor.load(LOOGLE / "d698fcb_predictor.json")


def test_share_fit_on_one_h200_run_predicts_a_held_out_one(tmp_path):
    """The planner's own prediction of what each prefill batch gets beside decode, the
    corrections (delivered over planned, a cost per batch) fitted on the eb12b7d run: the
    b249c95 run (another revision of the planner, its own load) comes out within 10% of
    its measured prefill time beside decode."""
    whatif = _load("mux_whatif")
    out = tmp_path / "fit.json"
    train = str(LOOGLE / "eb12b7d_multiplex_rate0.5_timeline.json.gz")
    held = str(LOOGLE / "b249c95_multiplex_rate0.5_timeline.json.gz")
    assert whatif.main(["--predictor", str(LOOGLE / "d698fcb_predictor.json"), "--fit-share",
                        train, "--hold-out", held, "--calibration-from",
                        str(LOOGLE / "eb12b7d_multiplex_rate0.5.json"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "analysis" and result["fitted_on"] == [train]
    fitted, checked = result["runs"][train], result["runs"][held]
    assert fitted["role"] == "fitted" and checked["role"] == "held out"
    assert fitted["error"] == pytest.approx(0.0, abs=1e-3)  # fitted on it alone: the sums agree
    assert abs(checked["error"]) < 0.10 and checked["batches"] > 40
    assert 0.5 < result["delivered_over_planned"] < 1.5 and result["per_batch_s"] > 0
    scalar = result["scalar"]  # one factor alone, for comparison
    assert scalar["runs"][held]["role"] == "held out" and scalar["delivered_over_planned"] > 0


def test_a_decision_that_recorded_its_decode_context_gives_it_as_is():
    """Older timelines: the context that gives the planner's predicted step; newer ones
    record it, and the recorded figure wins over the recovered one."""
    from pdserve.bench.timeline import load_engine_timeline
    from pdserve.sched.predictor import served_predictor

    whatif = _load("mux_whatif")
    predictor = served_predictor(LOOGLE / "d698fcb_predictor.json")
    entries = load_engine_timeline(LOOGLE / "eb12b7d_multiplex_rate0.5_timeline.json.gz")
    entry = next(e for e in entries if e["mode"] == "decode_only" and e["decode_batch"] > 1)
    recovered = whatif.decode_context(entry, predictor)
    assert recovered is not None and recovered > 0
    assert whatif.decode_context({**entry, "decode_context_tokens": 4321}, predictor) == 4321
    assert whatif.decode_context({**entry, "decode_context_tokens": 0}, predictor) == recovered


def test_graph_replay_of_a_measured_run_changes_choices_only_when_graph_steps_are_cheaper(
        tmp_path):
    """The eb12b7d run's decisions that start prefill work, re-planned with graph steps
    weighed: at the eager steps' cost almost nothing changes; measured cheaper, most mixed
    steps move onto the graphs and every option's expected rate rises or holds."""
    whatif = _load("mux_whatif")
    out = tmp_path / "replay.json"
    timeline = str(LOOGLE / "eb12b7d_multiplex_rate0.5_timeline.json.gz")
    assert whatif.main(["--predictor", str(LOOGLE / "d698fcb_predictor.json"), "--graph-replay",
                        timeline, "--graph-factors", "1.0,0.85", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    same, cheaper = (row["by_option"] for row in result["runs"][timeline])
    assert result["kind"] == "prediction" and same["temporal"]["decisions"] > 700
    assert sum(row["changed"] for row in same.values()) < 0.02 * sum(
        row["decisions"] for row in same.values())
    assert cheaper["temporal"]["to_graph_steps"] > 0.9 * cheaper["temporal"]["decisions"]
    assert all(row["expected_tokens_per_s_on"] >= row["expected_tokens_per_s_off"]
               for row in cheaper.values())


def test_share_table_follows_the_planner(tmp_path):
    """Beside a larger decode batch a prompt gets less (its factor rises), decode tokens
    come at least as slowly as alone, and the table has a cell per grid point."""
    whatif = _load("mux_whatif")
    settings = whatif.PlannerSettings(itl_ms=60.0)
    table = whatif.share_table(_h200_predictor(), settings, batches=(1, 32),
                               contexts=(4096, 8192), prompts=(2048, 8192))
    assert len(table["prefill"]) == len(table["decode"]) == 8
    by = dict(zip(itertools.product((1, 32), (4096, 8192), (2048, 8192)), table["prefill"],
                  strict=True))
    assert all(by[32, c, p] > by[1, c, p] for c in (4096, 8192) for p in (2048, 8192))
    assert min(table["prefill"]) > 1.0 and min(table["decode"]) >= 1.0
    assert min(table["prefill_batches"]) >= 1  # every prompt takes a batch at least


# --------------------------------------------------------------------------- decode GEMV A/B


def _result(mode: str, step_ms: dict[int, float]) -> dict:
    rows = [{"batch": b, "context": 1024, "overlap": True, "decode_gemv": mode,
             "step_ms": ms, "fraction_of_roofline": 15.8 / ms} for b, ms in step_ms.items()]
    rows.append({"batch": 256, "context": 1024, "overlap": True, "decode_gemv": mode,
                 "skipped": "KV pool too small for this batch and context"})
    return {"model": "codellama-34b", "decode": rows}


def test_speedup_pairs_off_and_on_of_the_same_point():
    bench = _load("bench_engine")
    results = [_result("off", {1: 18.0, 8: 20.0}), _result("on", {1: 16.0, 8: 25.0})]
    lines = bench.decode_gemv_speedups(results)
    assert [(line["batch"], line["decode_gemv_speedup"]) for line in lines] == \
        [(1, 18.0 / 16.0), (8, 20.0 / 25.0)]
    assert lines[0]["fraction_of_roofline_on"] == 15.8 / 16.0
    assert bench.decode_gemv_speedups([_result("off", {1: 18.0})]) == []


def test_ragged_decode_contexts_keep_the_mean_and_the_spread():
    bench = _load("bench_engine")
    assert bench.ragged_contexts(4, 512, 0.0) == [512] * 4
    assert bench.ragged_contexts(1, 512, 0.9) == [512]
    contexts = bench.ragged_contexts(48, 600, 0.9)
    assert contexts[0] == 1140 and contexts[-1] == 60 and len(contexts) == 48
    assert sum(contexts) / len(contexts) == pytest.approx(600, abs=1)
    with pytest.raises(ValueError, match="context spread 1.0"):
        bench.ragged_contexts(4, 512, 1.0)
    # One long context beside the rest, spread or not.
    assert bench.ragged_contexts(4, 512, 0.0, 8192) == [8192, 512, 512, 512]
    assert bench.ragged_contexts(3, 600, 0.9, 8192)[0] == 8192
    assert bench.ragged_contexts(1, 512, 0.0, 8192) == [8192]


def test_decode_gemv_and_point_arguments():
    bench = _load("bench_engine")
    assert bench._gemv_modes("off,on") == ("off", "on")
    with pytest.raises(argparse.ArgumentTypeError, match="off, on, or off,on"):
        bench._gemv_modes("off,fast")
    assert bench._int_list("1,2,4,8") == (1, 2, 4, 8)
    assert bench._int_list("none") == ()


@pytest.mark.skipif(not triton_available(), reason="bench_gemv.py imports triton")
def test_gemv_sweep_shapes_candidates_and_table(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run: it imports bench_kernels
    bench = _load("bench_gemv")
    shapes = bench.projections(PRESETS["codellama-34b"])
    assert {name: shape[:2] for name, shape in shapes.items()} == {
        "qkv": (10240, 8192), "o_proj": (8192, 8192), "gate_up": (44032, 8192),
        "down": (8192, 22016)}
    assert {c.use_dot for c in bench.candidates(1)} == {False, True}  # both forms
    assert all(c.use_dot for c in bench.candidates(8))
    best = {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 3, "use_dot": False,
            "us": 40.0}
    table = bench.config_table([{"n": 8192, "k": 8192, "rows": 3, "best": best}])
    assert table == ["    (8192, 8192, 4): GemvConfig(block_n=8, block_k=512, num_warps=4, "
                     "num_stages=3, use_dot=False),"]


@pytest.mark.skipif(not triton_available(), reason="bench_blas.py imports triton")
def test_blas_step_sums_weigh_each_projection_by_its_calls(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run: it imports bench_kernels
    bench = _load("bench_blas")
    arch = PRESETS["codellama-34b"]
    calls = {name: shape[2] for name, shape in bench.projections(arch).items()}
    assert calls == {"qkv": 48, "o_proj": 48, "gate_up": 48, "down": 48, "lm_head": 1}
    rows = [{"projection": name, "rows": 1, "cublas": {"us": 10.0},
             "cublaslt": {"us": 20.0 if name == "qkv" else 5.0}} for name in calls]
    sums = bench.step_sums(rows, arch)["1"]
    assert sums["cublas"] == pytest.approx(10.0 * 193 / 1e3)
    assert sums["cublaslt"] == pytest.approx((20.0 * 48 + 5.0 * 145) / 1e3)
    assert sums["best_of_both"] == pytest.approx((10.0 * 48 + 5.0 * 145) / 1e3)


@pytest.mark.skipif(not triton_available(), reason="bench_kernels.py imports triton")
def test_extend_sweep_times_every_layout_on_every_chunk_shape():
    """The sweep's points (the GPU timing replaced by a record of what it was asked), and
    the split count auto resolves to on each chunk shape (counting the H200's 132 SMs)."""
    import torch

    bench = _load("bench_kernels")
    from pdserve.ops.triton_attention import extend_grid

    asked = []
    rows = bench.sweep_extend(lambda row: row, lambda *point: asked.append(point) or {})
    assert len(rows) == len(asked) == 12 * 3 + 8 * 8
    layouts = {(cfg.pack_gqa, cfg.kv_splits, prefix, new) for _, prefix, new, cfg in asked}
    assert len(layouts) == 2 * 4 * 8  # the tile sweep's own layout is the plain one
    auto = {}
    for _, prefix, new, config in asked:
        if config.kv_splits == 0:
            meta = bench.extend_meta(prefix, new, torch.zeros(1, 1, dtype=torch.int32))
            grid, splits = extend_grid(config, meta, 64, 8, 0, torch.device("cpu"))
            auto[config.pack_gqa, prefix, new] = splits
    # Half a wave of programs or more is not split: 128 programs (256 tokens), 256, more.
    assert auto[True, 15360, 256] == auto[False, 12288, 256] == 1
    assert auto[False, 8192, 512] == 1
    assert auto[True, 0, 8192] == auto[False, 16384, 2048] == 1  # the grid fills the GPU
    # Short chunks over a prefix: 64 programs (32 packed) split to one wave.
    assert auto[False, 16384, 64] == auto[False, 16384, 128] == auto[False, 4096, 128] == 2
    assert auto[True, 16384, 64] == 4


@pytest.mark.skipif(not triton_available(), reason="bench_kernels.py imports triton")
def test_extend_waves_times_each_split_count_beside_the_auto_pick(monkeypatch):
    """``--extend-waves``: every chunk x prefix at 1, 2 and 4 splits, and per point the
    count auto picks (132 SMs counted on a CPU) with its time over one split's."""
    import functools

    import torch

    bench = _load("bench_kernels")
    from pdserve.ops.triton_attention import default_extend_config

    tiles = default_extend_config(128, torch.device("cuda"), hopper=True)
    monkeypatch.setattr(bench, "default_extend_config", lambda *args: tiles)
    monkeypatch.setattr(bench, "auto_extend_splits",
                        functools.partial(bench.auto_extend_splits, device="cpu"))
    speed = {1: 1.0, 2: 0.8, 4: 0.9}  # ms by split count: 2 the fastest everywhere
    asked_sms = set()

    def fake_prefill(shape, prefix, new, config, launch_sms=None):
        asked_sms.add(launch_sms)
        return {"prefix": prefix, "new": new, "ms": speed[config.kv_splits]}

    monkeypatch.setattr(bench, "bench_prefill", fake_prefill)
    result = bench.extend_waves(lambda row: row)
    points = len(bench.EXTEND_WAVE_CHUNKS) * len(bench.EXTEND_WAVE_PREFIXES)
    assert len(result["rows"]) == 3 * points and len(result["auto"]) == points
    picks = {(p["prefix"], p["new"]): p for p in result["auto"]}
    assert picks[12288, 320]["auto_splits"] == 2 and picks[12288, 320]["auto_over_one"] == 0.8
    assert picks[12288, 256]["auto_splits"] == 1 and picks[12288, 256]["auto_over_one"] == 1.0
    assert picks[16384, 64]["auto_splits"] == 2 and picks[16384, 64]["auto_over_one"] == 0.8
    assert {p["fastest_splits"] for p in result["auto"]} == {2}
    assert asked_sms == {None}

    # On a partition's 108 SMs: 8 splits timed too, and the rule counts 108 SMs, so a
    # 1-tile chunk over 16K (64 programs) splits further than on the whole GPU.
    speed[8] = 0.7
    on_part = bench.extend_waves(lambda row: row, sms=108)
    assert len(on_part["rows"]) == 4 * points and asked_sms == {None, 108}
    part_picks = {(p["prefix"], p["new"]): p for p in on_part["auto"]}
    assert part_picks[16384, 64]["auto_splits"] > picks[16384, 64]["auto_splits"]
    assert {p["launch_sms"] for p in on_part["auto"]} == {108}


@pytest.mark.skipif(not triton_available(), reason="bench_kernels.py imports triton")
def test_decode_split_ab_times_every_split_size_at_every_point(monkeypatch):
    bench = _load("bench_kernels")
    asked = []

    def fake_layers(shape, batch, context, config, splits, tokens):
        asked.append((config.one_launch, tokens, config.block_n))
        return {"splits": 32, "us_per_layer": tokens / 8}  # 128 tokens: 16 us, 64: 8 us

    monkeypatch.setattr(bench, "bench_decode_layers", fake_layers)
    rows = bench.decode_split_ab(lambda row: row)
    assert len(rows) == len(bench.SPLIT_AB_POINTS) and len(asked) == 3 * len(rows)
    assert set(asked) == {(False, 128, 64), (False, 64, 64), (False, 128, 128)}
    assert rows[0]["us_per_layer"] == {"128/64": 16.0, "64/64": 8.0, "128/128": 16.0}
    assert rows[0]["speedup"] == 2.0


def test_the_mixed_step_grid_covers_the_steps_the_chunked_model_misses(monkeypatch):
    """``bench_mixed_step.py --grid``: small chunks, long prefixes and several decode
    batches, each step within the engine's 24,576-token limit; without it the seven named
    cases its committed results hold."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = _load("bench_mixed_step")
    grid = bench.cases(True)
    assert len(set(grid)) == len(grid) == 54
    assert {c[0] for c in grid} >= {64, 128, 256, 512} and {c[1] for c in grid} >= {0, 16384}
    assert all(prefix + chunk <= 24576 for chunk, prefix, _, _ in grid)
    assert bench.cases(False) == bench.CASES and len(bench.CASES) == 7
    wide = bench.cases(True, (64, 128, 256), 512)  # the decode batches served steps carry
    assert len(wide) == 54 and {c[2] for c in wide} == {64, 128, 256}
    assert {c[3] for c in wide} == {512}


def test_mixed_step_cases_can_be_named_one_by_one(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = _load("bench_mixed_step")
    assert bench.parse_cases("255:14336:1:16384, 256:14336:1:16384") == (
        (255, 14336, 1, 16384), (256, 14336, 1, 16384))
    with pytest.raises(ValueError, match="want tokens:prefix:decodes:context"):
        bench.parse_cases("255:14336:1")


def _mixed_entry(prefix: int, tokens: int, decodes: int, ms: float) -> dict:
    return {"mode": "temporal", "path": "piecewise_graph", "prefill_pieces": [[prefix, tokens]],
            "decode_batch": decodes, "decode_context_tokens": 1000 * decodes,
            "measured_device_ms": ms}


def test_steps_on_a_graph_bucket_are_set_against_the_line_through_the_others():
    """Steps cost 10 ms + 0.1 ms per replayed (bucket-padded) token; those ending on a
    bucket pay for no padding, so they run under the line through the padded ones."""
    align = _load("step_alignment")
    timeline = [_mixed_entry(prefix, n, b, 10 + 0.1 * (-(-(n + b) // 16) * 16))
                for prefix in (0, 4000, 9000, 13000) for n in (96, 192, 256, 304, 368)
                for b in (1, 2, 3)]
    timeline += [_mixed_entry(9000, 254, 2, 10 + 0.1 * 256), {"mode": "decode_only"}]
    steps = align.mixed_steps(timeline)
    assert len(steps) == 61
    found = align.on_bucket(steps, 16)
    assert found["on_bucket_steps"] == 1 and found["on_bucket_totals"] == [256]
    assert found["on_bucket_over_line_p50"] < 0.97
    assert found["tokens_past_a_bucket"]["0"] == 1
    bands = align.by_band(steps)
    assert [b["prefix"][0] for b in bands] == [0, 4000, 8000, 12000]
    assert bands[0]["steps"] == 15 and bands[2]["steps"] == 16


def test_attention_priced_in_waves_explains_the_three_tile_steps():
    """Steps whose attention costs 1 ms per wave per 1K prefix (64 q heads, 128-token
    tiles, 132 SMs: 2 tiles one wave, 3 and 4 tiles two): the waves fit leaves nothing by
    tile count, the fit linear in the chunk leaves the 3-tile steps above it; counted at
    the kernel's own split rule, 3 tiles run 2 splits, 1.5 waves."""
    align = _load("step_alignment")

    def ms(prefix, tokens, decodes, waves):
        return 5 + 0.1 * tokens + waves * prefix / 1e3 + 0.3 * decodes

    waves_unsplit = {192: 1, 256: 1, 320: 2, 384: 2, 448: 2, 512: 2}
    timeline = [_mixed_entry(prefix, n, b, ms(prefix, n, b, waves_unsplit[n]))
                for prefix in (2000, 6000, 10000, 14000) for n in waves_unsplit for b in (1, 3)]
    steps = align.mixed_steps(timeline)
    found = align.attention_waves(steps, 132, 64, 128, auto_splits=False)
    assert found["steps_by_tiles"] == {"2": 16, "3": 16, "4": 16}
    waves, linear = found["fits"]["waves_x_prefix"], found["fits"]["tokens_x_prefix"]
    assert waves["rms_relative_error"] < 1e-6 and waves["coef"][2] == pytest.approx(1.0)
    assert linear["residual_p50_by_tiles"]["3"] > 1.03 > linear["residual_p50_by_tiles"]["2"]
    pytest.importorskip("triton")
    split = align.attention_waves(steps, 132, 64, 128, auto_splits=True)
    assert split["fits"]["waves_x_prefix"]["rms_relative_error"] > 0.01  # 3 tiles now 1.5


def test_the_prefill_bound_is_the_least_rate_some_set_of_requests_passes_at():
    bound = _load("loogle_bound")
    # Two 1,000-token prompts at once, SLO 1 s: both need 2,000 tokens/s, one needs 1,000.
    assert bound.least_prefill_rate([0.0, 0.0], [1000, 1000], 1.0, 1.0) == pytest.approx(
        2000, abs=1)
    assert bound.least_prefill_rate([0.0, 0.0], [1000, 1000], 1.0, 0.5) == pytest.approx(
        1000, abs=1)
    # Arrivals at 0 and 1 s: with a 2 s SLO the first prompt's 2,000 tokens by t=2 and all
    # 3,000 by t=3 both need 1,000 tokens/s; with a 1 s SLO the first alone needs 2,000.
    assert bound.least_prefill_rate([0.0, 1.0], [2000, 1000], 1.0 + 1.0, 1.0) == \
        pytest.approx(1000, abs=1)
    assert bound.least_prefill_rate([0.0, 1.0], [2000, 1000], 1.0, 1.0) == pytest.approx(
        2000, abs=1)


def test_the_effective_prefill_rate_recovers_the_rate_a_fcfs_server_ran_at():
    bound = _load("loogle_bound")
    arrivals, tokens = [0.0, 0.5, 1.0, 4.0], [3000, 2000, 4000, 1000]
    ttft = bound.fcfs_ttft_s(arrivals, tokens, 2000.0)
    assert ttft.tolist() == pytest.approx([1.5, 2.0, 3.5, 1.0])
    record = {"samples": [{"send_s": a, "prompt_len": p, "ttft_ms": 1e3 * t}
                          for a, p, t in zip(arrivals, tokens, ttft, strict=True)]}
    assert bound.effective_prefill_rate(record) == 2000.0


def test_mixed_step_split_arms_are_checked_and_switch_the_kernel(monkeypatch):
    """``bench_mixed_step.py --extend-splits``: each arm a valid value of the variable,
    and switching arms changes what the next extend launch reads (the variable is cached)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = _load("bench_mixed_step")
    from pdserve.ops import triton_attention

    assert bench.parse_splits("1, 0,4") == ("1", "0", "4")
    for bad in ("3", "auto", "-1"):
        with pytest.raises(ValueError, match="want 0 \\(auto\\) or a power of two"):
            bench.parse_splits(bad)
    monkeypatch.setenv(triton_attention.EXTEND_SPLITS_ENV, "1")
    triton_attention._extend_splits_from_env.cache_clear()
    try:
        assert triton_attention._extend_splits_from_env() == 1
        bench.use_extend_splits("0")
        assert triton_attention._extend_splits_from_env() == 0
        bench.use_extend_splits("2")
        assert triton_attention._extend_splits_from_env() == 2
    finally:  # the next reader sees the environment as the fixture leaves it
        triton_attention._extend_splits_from_env.cache_clear()
