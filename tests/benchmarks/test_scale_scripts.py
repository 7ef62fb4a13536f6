"""The fleet simulation and scale scripts, run small: real processes, real HTTP, a real
ZooKeeper (the scale script starts one, as the cluster tests do)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "mooncake_conversation_trace_300.jsonl"  # its first 300 rows
ENGINE = ROOT / "benchmarks" / "results" / "engine_h200_codellama34b.json"


def _run(script: str, *args: str, out: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    return json.loads(out.read_text())


def test_fleet_dispatch_comparison_reports_each_policy_as_a_simulation(tmp_path):
    result = _run("sim_fleet.py", "--trace", str(TRACE), "--engine-results", str(ENGINE),
                  "--compare", "dispatch", "--instances", "120", "--scenarios", "6",
                  "--duration-s", "120", out=tmp_path / "fleet.json")
    assert result["kind"] == "simulation" and result["num_instances"] == 120
    assert [r["dispatch"] for r in result["rows"]] == ["on-demand", "least-connections",
                                                       "round-robin"]
    assert all(r["requests"] > 500 and len(r["by_minute"]) == 2 for r in result["rows"])
    assert result["command"][0].endswith("sim_fleet.py") and result["git_revision"]
    # the simulation's CPU time, and how busy the host was around it
    assert all(r["sim_cpu_s"] > 0 and len(r["host_load_1_5_15_min"]["end"]) == 3
               for r in result["rows"])


def test_fleet_multiplexing_on_the_planner_model_of_a_validated_run(tmp_path):
    """``--multiplex-model-from``: the multiplexing groups run the planner model built from
    a committed H200 validation (as its --resimulate builds it), and the row says so; by
    default the two fixed slowdowns run."""
    validation = ROOT / "benchmarks" / "results" / "sim_validate_instance_h200_5d0f7fe.json"
    common = ("--trace", str(TRACE), "--engine-results", str(ENGINE), "--compare",
              "multiplex", "--instances", "20", "--scenarios", "2", "--duration-s", "60")
    with ThreadPoolExecutor(2) as pool:  # two independent processes: one a core
        planned_run = pool.submit(_run, "sim_fleet.py", *common, "--multiplex-model-from",
                                  str(validation), out=tmp_path / "planner.json")
        fixed_run = pool.submit(_run, "sim_fleet.py", *common, out=tmp_path / "fixed.json")
    planned, fixed = planned_run.result(), fixed_run.result()
    assert [r["multiplex_model"] for r in planned["rows"]] == [None, "planner"]
    assert [r["multiplex_model"] for r in fixed["rows"]] == [None, "fixed"]
    assert planned["config"]["multiplex_model_from"] == str(validation)
    # the same arrivals, served differently
    assert planned["rows"][1]["requests"] == fixed["rows"][1]["requests"] > 0
    assert planned["rows"][1]["ttft_p50_s"] != fixed["rows"][1]["ttft_p50_s"]


def test_gateway_capacity_through_the_real_gateway_and_stand_ins(tmp_path):
    result = _run("scale_gateway.py", "--gateways", "1,2", "--concurrency", "2",
                  "--duration-s", "1", "--group-size", "5", out=tmp_path / "gateway.json")
    assert result["kind"] == "measured"
    paths = [(r["path"], r.get("gateways")) for r in result["rows"]]
    assert paths == [("direct to a stand-in's /pd/decode", None),
                     ("through the gateway", 1), ("through the gateway", 2)]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in result["rows"])


def test_registry_scale_on_a_real_zookeeper(tmp_path):
    pytest.importorskip("kazoo")
    if shutil.which("java") is None or not Path("/usr/share/java/zookeeper.jar").exists():
        pytest.skip("Debian package zookeeper not installed")
    result = _run("scale_registry.py", "--instances", "40", "--scenarios", "4",
                  "--registrars", "2", "--watchers", "2", "--probes", "2",
                  out=tmp_path / "registry.json")
    assert result["registration"]["instances"] == 40
    assert len(result["gateway_start"]["cache_fill_s"]) == 2
    for change in ("register", "move", "unregister"):
        assert result["propagation_to_every_watcher"][change]["samples"] == 2
    rss = result["zookeeper_rss_mib"]
    assert 0 < rss["empty"] <= rss["with_watchers"] * 2  # the JVM's own, read from /proc


def test_validation_puts_measured_and_simulated_side_by_side(tmp_path):
    result = _run("validate_sim.py", "--requests", "6", "--repeats", "1", "--rate", "2",
                  "--prompt-rounds", "2",
                  "--prompt-lens", "32,64", "--decode-batches", "1,2",
                  "--decode-contexts", "32", "--min-output", "12", "--max-output", "20",
                  "--sharing-cycles", "1", "--decode-steps", "64",
                  "--idle-pauses-s", "0.1,0.3", "--warmup-s", "0.5",
                  out=tmp_path / "validation.json")
    assert result["kind"] == "validation"
    # The instances ran with glibc's heap kept (the default), and the run says so.
    kept = _script("validate_sim").KEEP_HEAP_ENV
    assert {k: result["instance_environment"][k] for k in kept} == kept
    assert result["config"]["keep_heap"] is True
    # The shared-cores factors are the probe's medians, as the simulations used them.
    probe = result["shared_cores_probe"]
    assert probe["decode_step_ms_alone"]["samples"] > 0
    assert result["shared_cores"]["decode_slowdown"] == pytest.approx(
        probe["decode_step_ms_beside_prefill"]["p50"] / probe["decode_step_ms_alone"]["p50"])
    # prompts beside a decode: the factor of those sent on the replay's path
    assert probe["prefill_beside_decode_over_alone"]["samples"] > 0
    assert result["shared_cores"]["prefill_slowdown"] == pytest.approx(
        probe["prefill_on_path_beside_decode_over_alone"]["p50"])
    # the idle probe's line per pause, from its samples, as the simulations used it
    samples = result["idle_probe"]["samples"]
    assert {pause for _, pause, _ in samples} == {0.0, 0.1, 0.3}
    fitted = _script("validate_sim").idle_wake_points(samples, [0.1, 0.3])
    assert np.concatenate(result["idle_wake"]["points"]) == pytest.approx(
        np.concatenate(fitted))
    assert len(result["service_points"]["decode"][0]["round_step_ms"]) == 3
    # the group warmed first: at least one untimed round of every length, kept apart
    warm = result["warmup"]
    assert warm["seconds"] >= 0.5 and set(warm["ttft_ms"]) == {"32", "64"}
    assert len({len(ttfts) for ttfts in warm["ttft_ms"].values()}) == 1
    assert len(result["service_ratios"]["prefill"]) == 4
    # one untimed round first, recorded beside and kept out of the fit and the spread
    assert all(len(p["warmup_step_ms"]) == 1 for p in result["service_points"]["decode"])
    # Timed again after the replay (one decode round); a model fitted to both sides beside.
    again = result["recalibration"]["service_points"]
    assert len(again["decode"][0]["round_step_ms"]) == 1
    assert again["decode"][0]["warmup_step_ms"] == []  # the instance is warm by then
    assert set(result["recalibration"]["drift"]) == {"prefill", "prefill_direct", "decode"}
    module = _script("validate_sim")
    pooled = module.bracketed(result["service_points"], again)
    refit = module.fitted_model(pooled, SimpleNamespace(model="tiny", link_gb_per_s=1.5,
                                                        decode_kv_tokens=100_000))
    assert result["recalibration"]["latency_model_both_sides"] == pytest.approx(
        dataclasses.asdict(refit))
    before = module.fitted_model(result["service_points"], SimpleNamespace(
        model="tiny", link_gb_per_s=1.5, decode_kv_tokens=100_000))
    assert result["latency_model"] == pytest.approx(dataclasses.asdict(before))
    assert set(result["host_cpu"]) == {"calibration", "replay", "recalibration"}
    assert result["cores"]["prefill"] == [min(result["cores"]["gateway_and_client"])]
    assert 0 <= result["decode_hold_probability"] < 1
    # The prefill instance's steps as its engine reports them: chunked on a CPU, where a
    # step's tokens come back after the next step ran.
    assert result["prefill_steps"] == {"chunk_tokens": 512, "tokens_one_step_late": True}
    assert len(result["service_points"]["prefill"]) == 2
    # the prompts through the gateway timed in rounds: one of each length per round
    assert [len(p["samples_s"]) for p in result["service_points"]["prefill"]] == [2, 2]
    assert len(result["service_ratios"]["prefill"]) == 4
    spread = result["prompt_spread"]
    assert spread["calibration_samples"] == 4 and spread["replay_samples"] == 6
    assert spread["replay_sd"] == pytest.approx(np.std(_script("validate_sim").replay_prompt_ratios(
        result["requests"], result["measured_token_times_s"])))
    assert result["service_spread"]["decode_step"]["samples"] >= 4
    assert [p["tokens"] for p in result["service_points"]["handoff"]] == [32, 64]
    # Only requests whose first token came alone in its chunk give a first gap; which do
    # depends on the sampled ids (text held back as incomplete UTF-8 joins the next chunk).
    assert 1 <= result["measured_decode_timing"]["first_gap_ms"]["samples"] <= 6
    for key in ("ttft_s", "tpot_s"):
        row = result["compare"][key]
        for side in ("measured", "simulated", "simulated_medians_only",
                     "simulated_without_handoff", "simulated_without_shared_cores",
                     "simulated_without_held_stretches", "simulated_without_prefill_steps",
                     "simulated_without_idle_wake", "simulated_with_direct_prompt_factor",
                     "simulated_calibrated_both_sides", "simulated_at_replay_host_speed",
                     "simulated_at_replay_decode_engine_speed",
                     "simulated_with_prefill_host_spread",
                     "simulated_with_replay_prompt_spread"):
            assert 0 < row[side]["p50"] <= row[side]["p99"]
        assert row["simulated_error"]["p50"] == pytest.approx(
            row["simulated"]["p50"] / row["measured"]["p50"] - 1)
    # Each instance's engine steps during the replay: the prefill instance prefilled every
    # prompt (and sampled each first token), the decode instance decoded every later token.
    steps = {role: [dict(zip(part["fields"], row, strict=True)) for row in part["rows"]]
             for role, part in result["replay_steps"].items()}
    requests = result["requests"]
    assert sum(r["prefill_tokens"] for r in steps["prefill"]) == sum(r[1] for r in requests)
    assert sum(r["decode_batch"] for r in steps["decode"]) >= sum(r[2] - 1 for r in requests)
    assert all(0 <= r["t"] <= 60 for part in steps.values() for r in part)
    # The host meter timed its work on each instance's core through every phase.
    meter = result["host_meter"]
    assert set(meter["samples"]) == {"prefill", "decode"}
    for role, phases in meter["over_calibration"].items():
        assert set(phases) == {"calibration", "replay", "recalibration"}, role
        assert phases["calibration"]["p50"] == pytest.approx(1.0)
    assert any(t < 0 for t, _ in meter["samples"]["decode"])  # before the replay began
    # the model run at the meter's replay speed on each core, as a simulation beside
    assert result["replay_host_speed"] == {
        role: meter["over_calibration"][role]["replay"]["p50"] for role in ("prefill", "decode")}
    assert _script("validate_sim").replay_host_speed({"over_calibration": {}}) is None
    # and at the decode engine's own speed in the replay: its decode-only steps over the model
    over = _script("validate_sim").decode_steps_over_model(
        result["replay_steps"], _script("validate_sim").LatencyModel(**result["latency_model"]))
    assert result["replay_decode_engine_speed"] == pytest.approx(over["p50"])
    assert _script("validate_sim").replay_decode_engine_speed(None, None) is None
    # and, apart, a read of a buffer the size of the model's working set, sample by sample
    for role, cache in meter["cache_samples"].items():
        assert [t for t, _ in cache] == [t for t, _ in meter["samples"][role]], role
        assert all(ms > 0 for _, ms in cache)
        assert meter["cache_over_calibration"][role]["calibration"]["p50"] == pytest.approx(1)
    check = result["replay_steps_check"]
    assert check["requests"] >= 1
    assert 0 < check["tpot_over_engine_steps"]["p10"] <= check["tpot_over_engine_steps"]["p90"]


def test_the_cpu_decode_state_ab_alternates_every_pair(tmp_path):
    """Small: two rounds of 64-token probes, the served engine (and the served P/D
    group) churned by 2 requests and 1 between rounds, the idle one's pause 0.1 s."""
    result = _run("cpu_decode_state_ab.py", "--rounds", "2", "--churn", "2",
                  "--churn-between-rounds", "1", "--context", "64", "--pause-s", "0.1",
                  "--core", str(min(os.sched_getaffinity(0))),
                  "--prefill-core", str(max(os.sched_getaffinity(0))),
                  out=tmp_path / "ab.json")
    assert result["kind"] == "ab"
    for part, keys in ((result["served"], {"fresh_ms", "served_ms"}),
                       (result["pages"], {"contiguous_ms", "shuffled_ms"}),
                       (result["idle"], {"back_to_back_ms", "after_pause_ms"}),
                       (result["pd_served"]["decode"], {"fresh_ms", "served_ms"}),
                       (result["pd_served"]["prefill"], {"fresh_ms", "served_ms"})):
        rounds = part["rounds"]
        assert len(rounds) == 2 and all(set(r) == keys and min(r.values()) > 0
                                        for r in rounds)
        assert part["ratio_min"] <= part["ratio_median"] <= part["ratio_max"]
    # each probe's prompt found in its prefill instance's steps (a 64-token prompt of the
    # tiny model takes milliseconds on a CPU)
    assert all(r["fresh_ms"] > 0.5 and r["served_ms"] > 0.5
               for r in result["pd_served"]["prefill"]["rounds"])


def test_the_host_meter_is_split_by_phase_over_its_calibration_median():
    """Samples 2 ms through calibration, 3 ms in the replay (from 0 s), 2.2 ms after."""
    module = _script("validate_sim")
    rows = [[t, 2.0] for t in range(-10, 0)] + [[t, 3.0] for t in range(0, 20)]
    rows += [[t, 2.2] for t in range(20, 25)]
    marks = {"calibration": 90.0, "replay": 100.0, "recalibration": 120.0}
    phases = module.meter_phases({"decode": rows}, 100.0, marks)["decode"]
    assert phases["calibration"]["p50"] == 1.0 and phases["replay"]["p50"] == 1.5
    assert phases["recalibration"]["p99"] == pytest.approx(1.1)
    assert module.meter_phases({"decode": rows}, 100.0, {"replay": 100.0}) == {}


def test_prompt_rounds_split_into_the_calibrations_groups():
    groups = _script("validate_sim").round_groups
    assert groups(15, 5) == [3, 3, 3, 3, 3]
    assert groups(7, 5) == [2, 2, 1, 1, 1] and groups(2, 5) == [1, 1, 0, 0, 0]


def test_prompt_spread_takes_each_ttft_over_its_lengths_median_and_follows_the_meter():
    """Two 64-token prompts (TTFT 0.1 and 0.3 s) and two of 128 (0.2 and 0.4 s); the
    prefill core's meter reads 1x through calibration and 2x around the slow ones."""
    module = _script("validate_sim")
    requests = [[0.0, 64, 2], [10.0, 64, 2], [20.0, 128, 2], [30.0, 128, 2]]
    times = [[0.1, 0.2], [10.3, 10.4], [20.2, 20.3], [30.4, 30.5]]
    assert module.replay_prompt_ratios(requests, times) == pytest.approx(
        [0.5, 1.5, 2 / 3, 4 / 3])
    meter = [[-2.0, 1.0], [-1.0, 1.0], [0.0, 1.0], [10.0, 2.0], [20.0, 1.0], [30.0, 2.0]]
    run = {"requests": requests, "measured_token_times_s": times,
           "service_ratios": {"prefill": [0.9, 1.0, 1.1]},
           "host_meter": {"samples": {"prefill": meter}}}
    simulated = [{"ttft_s": 0.1}, {"ttft_s": 0.1}, {"ttft_s": 0.2}, {"ttft_s": 0.2}]
    spread = module.prompt_spread(run, simulated)
    assert spread["calibration_sd"] == pytest.approx(np.std([0.9, 1.0, 1.1]))
    assert spread["replay_sd"] == pytest.approx(np.std([0.5, 1.5, 2 / 3, 4 / 3]))
    # measured over simulated 1, 3, 1, 2 against meter readings 1, 2, 1, 2
    assert spread["first_token_over_simulated_vs_meter_correlation"] == pytest.approx(
        np.corrcoef([1, 3, 1, 2], [1, 2, 1, 2])[0, 1])
    del run["host_meter"]
    assert module.prompt_spread(run, simulated)[
        "first_token_over_simulated_vs_meter_correlation"] is None


def test_instance_validation_smoke_runs_both_schedules_end_to_end(tmp_path):
    """The H200 command's own steps on the tiny model on CPU: two real instances, the
    trace window replayed, both models simulated, one JSON under --out. The replays last
    3 s instead of the smoke's 20 (15-25 requests each), the calibration times each length
    and batch once instead of 3 times (nothing below counts its samples), and the probes'
    decode streams 200 tokens instead of 400 (the prompts they must cover take ~10 steps
    after a 0.3 s warm-up of ~30): a flag beside --smoke wins over its value."""
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_validate_instance.py"),
                    "--smoke", "--replay-s", "3", "--repeats", "1", "--mix-steps", "200",
                    "--out", str(out)],
                   check=True, cwd=ROOT,
                   timeout=900, env={**os.environ, "PDSERVE_GIT_REVISION": "abc123"})
    result = json.loads((out / "sim_validate_instance.json").read_text())
    assert result["kind"] == "validation" and result["git_revision"] == "abc123"
    assert result["config"]["replay_s"] == 3.0 and result["config"]["model"] == "tiny"
    assert result["config"]["mix_steps"] == 200 and result["config"]["repeats"] == 1
    assert set(result["schedules"]) == {"chunk512", "multiplex"}
    for name, run in result["schedules"].items():
        assert run["workload"]["window_s"] == [0.0, 600.0] and run["workload"]["requests"] > 5
        for key in ("ttft_s", "tpot_s"):
            for side in ("measured", "simulated", "simulated_medians_only"):
                assert 0 < run["compare"][key][side]["p50"] <= run["compare"][key][side]["p99"]
        assert (out / f"{name}_server.log").stat().st_size > 0
    multiplex = result["schedules"]["multiplex"]["interference"]
    queue = multiplex["queue"]
    assert multiplex["cycle_s"] == pytest.approx(queue["step_ms_during"] / 1e3)
    assert queue["prefill_over_alone"] > 0 and "cycle_model_prefill_over_alone" in queue
    for window in ("timeline_probes", "timeline_replay"):
        assert multiplex[window]["decisions"] > 0
        # each window's decisions kept whole beside the result
        with gzip.open(out / f"multiplex_{window}.json.gz", "rt") as f:
            assert len(json.load(f)) >= multiplex[window]["decisions"]
    chunked = result["schedules"]["chunk512"]
    for probe in (chunked["interference"], chunked["interference"]["queue"]):
        assert probe["steps_during"] > 0 and probe["predicted_step_ms_during"] > 0
    assert chunked["interference"]["queue"]["prompts"] == 2
    assert len(chunked["measured_per_request"]) == chunked["workload"]["requests"]
    assert len(chunked["service_ratios"]["decode_step"]) == chunked["service_spread"][
        "decode_step"]["samples"]
    # The chunked replay's steps, kept beside the result and set against the model.
    check = chunked["interference"]["replay_steps_check"]
    assert check["steps"] > 0 and check["clock"] == "host"
    assert {g["mode"] for g in check["groups"]} >= {"decode_only"}
    with gzip.open(out / "chunk512_steps_replay.json.gz", "rt") as f:
        assert len(json.load(f)) >= check["steps"]


VALIDATION_H200 = ROOT / "benchmarks" / "results" / "sim_validate_instance_h200_eb12b7d.json"
TRACE_OF_H200 = ROOT / json.loads(VALIDATION_H200.read_text())["config"]["trace"]


def test_resimulation_with_the_models_as_of_eb12b7d_gives_the_committed_figures():
    """That run recorded no spread ratios: only its medians-only simulation can be drawn
    again, and it is, to the last digit."""
    module = _script("sim_validate_instance")
    recorded = json.loads(VALIDATION_H200.read_text())
    again = module.resimulate(str(VALIDATION_H200), "eb12b7d")
    for name, run in recorded["schedules"].items():
        for key in ("ttft_s", "tpot_s"):
            row = again["schedules"][name][key]
            assert row["simulated_medians_only"] == run["compare"][key]["simulated_medians_only"]
            assert row["measured"] == run["compare"][key]["measured"]
            assert "simulated" not in row


def test_resimulation_from_the_command_line_with_the_models_of_now(tmp_path):
    """The recorded run's chunked schedule alone: the multiplexing one would walk the
    planner's share table (~9 s), which the planner test below runs in-process; the command
    line prints every schedule with the same loop, and keeps the re-simulation with --out."""
    recorded = json.loads(VALIDATION_H200.read_text())
    del recorded["schedules"]["multiplex"]
    path = tmp_path / "chunked_only.json"
    path.write_text(json.dumps(recorded))
    kept = tmp_path / "resimulated.json"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_validate_instance.py"),
                          "--resimulate", str(path), "--out", str(kept)], check=True, cwd=ROOT,
                         timeout=300, capture_output=True, text=True).stdout.splitlines()
    assert out[0].startswith(f"re-simulated offline from {os.path.relpath(path, ROOT)}")
    written = json.loads(kept.read_text())
    assert written["kind"] == "validation" and written["models_as_of"] == "current"
    assert set(written["schedules"]) == {"chunk512"}
    rows = {tuple(line.split(" ", 2)[:2]): json.loads(line.split(" ", 2)[2]) for line in out[1:]}
    assert set(rows) == {("chunk512", "ttft_s"), ("chunk512", "tpot_s")}
    chunked = rows[("chunk512", "ttft_s")]["simulated_medians_only"]
    assert chunked != recorded["schedules"]["chunk512"]["compare"]["ttft_s"][
        "simulated_medians_only"]


def test_resimulation_runs_the_planner_model_fitted_on_the_runs_own_probe(monkeypatch):
    """Beside the cycle model, the planner model: its table walked from the run's own
    predictor, and how much of the plan the instance delivered fitted by replaying the run's
    lone probe on the instance model (that run had no queue probe, nor a probe timeline: its
    pieces are timed by the corrections): the probe's prompt comes back as measured. The
    share is the one the re-simulation built (its table's walk is most of this test's time:
    walked once, not twice)."""
    module = _script("sim_validate_instance")
    recorded = json.loads(VALIDATION_H200.read_text())
    run = recorded["schedules"]["multiplex"]
    args = module.argparse.Namespace(**recorded["config"])
    model = module.LatencyModel(**run["latency_model"])
    built = []  # (arguments, share) of each planner_share call the re-simulation makes
    planner_share = module.planner_share

    def recording(*arguments):
        built.append((arguments, planner_share(*arguments)))
        return built[-1][1]

    monkeypatch.setattr(module, "planner_share", recording)
    again = module.resimulate(str(VALIDATION_H200))
    assert len(built) == 1
    (schedule_args, interference, built_model, built_args, as_of, only), share = built[0]
    assert (schedule_args, interference, built_model) == (run["schedule_args"],
                                                          run["interference"], model)
    assert (as_of, only) == ("current", None)
    assert share.per_batch_s == 0.0
    assert module.simulated_mux_probe_s(model, share, built_args, {"prompts": 1, **run[
        "interference"]}, args.mix_steps) == pytest.approx(run["interference"]["prompt_s"],
                                                           rel=0.01)
    planner = again["cycle_covers_every_batch"]["multiplex_planner"]
    assert planner["delivered_from"] == "lone probe" and planner["covers_every_batch"]
    assert planner["delivered_over_planned"] == pytest.approx(share.delivered)
    assert planner["piece_timing"] == {}
    for key in ("ttft_s", "tpot_s"):
        row = again["schedules"]["multiplex"][key]
        assert 0 < row["simulated_planner_medians_only"]["p50"] \
            <= row["simulated_planner_medians_only"]["p99"]
        assert "simulated_planner_medians_only" not in again["schedules"]["chunk512"][key]
    roofline = module.planner_share("--schedule multiplex --mux-predictor roofline",
                                    run["interference"], model, args)
    assert roofline is None  # said in the result (``_share_summary``), never silent


def test_resimulation_with_the_planner_model_as_of_7dad880_gives_the_committed_figures():
    """The 7dad880 run's planner figures (its pieces timed by the engine's corrections, the
    LooGLE per-batch cost, the closed-form delivered factor) come back (to float rounding:
    the P99 differs in its 14th digit)."""
    module = _script("sim_validate_instance")
    path = ROOT / "benchmarks" / "results" / "sim_validate_instance_h200_7dad880.json"
    recorded = json.loads(path.read_text())["schedules"]["multiplex"]["compare"]
    again = module.resimulate(str(path), "7dad880")["schedules"]["multiplex"]
    for key in ("ttft_s", "tpot_s"):
        for side in ("simulated_planner_medians_only", "simulated_planner"):
            for quantile, value in recorded[key][side].items():
                assert again[key][side][quantile] == pytest.approx(value, rel=1e-9)


def test_resimulation_draws_the_recorded_spread(tmp_path):
    """With ``service_ratios`` recorded (runs after eb12b7d), the noisy simulation runs too:
    ratios of exactly 1 draw the medians."""
    module = _script("sim_validate_instance")
    recorded = json.loads(VALIDATION_H200.read_text())
    del recorded["schedules"]["multiplex"]
    recorded["schedules"]["chunk512"]["service_ratios"] = {"prefill": [1.0],
                                                           "decode_step": [1.0]}
    path = tmp_path / "recorded.json"
    path.write_text(json.dumps(recorded))
    row = module.resimulate(str(path))["schedules"]["chunk512"]["ttft_s"]
    assert row["simulated"] == pytest.approx(row["simulated_medians_only"], rel=1e-9)


def test_chunked_probe_prediction_by_hand():
    from argparse import Namespace

    from pdserve.sim.cluster import LatencyModel

    module = _script("sim_validate_instance")
    model = LatencyModel(1e-4, 0.0, 0.02, 0.0, 1e-6, kv_bytes_per_token=1)
    args = Namespace(mix_batch=12, mix_prompt=1000, mix_warmup_s=0.1)
    lone = {"prompts": 1, "decode_context": 100, "step_ms_before": 10.0}
    # 10 steps decoded by the prompt's arrival: 12 x 110 KV tokens, one more each per step;
    # two pieces of 500 tokens, each step 512 tokens of compute (51.2 ms).
    predicted = module.chunked_probe_prediction(model, args, lone)
    steps = [0.0512 + 1320e-6, 0.0512 + 1332e-6]
    assert predicted["predicted_step_ms_during"] == pytest.approx(np.median(steps) * 1e3)
    assert predicted["predicted_prompt_s"] == pytest.approx(sum(steps))
    # Two prompts of 700 queued: 500 of the first; its last 200 and 300 of the second in
    # one step; the second's last 400.
    args.mix_prompt = 700
    queued = module.chunked_probe_prediction(model, args, {**lone, "prompts": 2})
    steps = [0.0512 + 1320e-6, 0.0512 + 1332e-6, 0.0412 + 1344e-6]
    assert queued["predicted_step_ms_during"] == pytest.approx(np.median(steps) * 1e3)
    assert queued["predicted_prompt_s"] == pytest.approx(sum(steps))



def test_instruction_count_arguments_parse_and_a_bad_window_is_refused(capsys):
    from benchmarks import sim_instructions as script

    args = script.parse_args(["--trace", str(TRACE), "--engine-results", str(ENGINE)])
    assert (args.start_s, args.end_s, args.instances, args.scenarios) == (40.0, 45.0, 10_000, 200)
    with pytest.raises(SystemExit):
        script.parse_args(["--trace", str(TRACE), "--engine-results", str(ENGINE),
                           "--start-s", "5", "--end-s", "5"])
    assert "--start-s < --end-s" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_instruction_count_covers_only_the_window(tmp_path):
    result = _run("sim_instructions.py", "--trace", str(TRACE), "--engine-results", str(ENGINE),
                  "--instances", "40", "--scenarios", "2", "--duration-s", "10",
                  "--start-s", "2", "--end-s", "3", out=tmp_path / "instructions.json")
    assert result["kind"] == "measurement" and result["num_instances"] == 40
    assert result["arrivals"] > 0
    # Python's start and the fleet's set-up alone run to hundreds of millions: counted,
    # they would put a request far above what the simulator spends on it.
    assert 1_000 < result["instructions_per_request"] < 1_000_000
    assert result["instructions"] == pytest.approx(
        result["instructions_per_request"] * result["arrivals"])


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_timing_counts_tokens_not_chunks():
    """With dummy weights a streamed chunk can carry several tokens (held back as incomplete
    UTF-8): the validation's decode timing counts them by the chunk's logprobs (the H200
    run stopped with no decode samples when it counted chunks)."""
    module = _script("validate_sim")
    three = {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "", "b"]}}]}
    assert module.tokens_in_chunk(three) == 3
    assert module.tokens_in_chunk({"choices": [], "usage": {"completion_tokens": 9}}) == 0
    assert module.tokens_in_chunk({"choices": [{"text": "", "logprobs": None}]}) == 0


def test_decode_timing_sorts_later_steps_by_a_newcomer_joining():
    """A runs alone at 10 ms a step, B's first token comes at 0.20 s and its second (the
    step it joined in, 25 ms for A) at 0.225 s; they then share 12 ms steps. A's first gap
    (its handoff) is 50 ms."""
    module = _script("validate_sim")
    a = [0.0, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11, 0.12, 0.13, 0.14, 0.15, 0.16, 0.17,
         0.18, 0.19, 0.2, 0.225, 0.237, 0.249]
    b = [0.2, 0.2251, 0.2371, 0.2491, 0.2611]
    timing = module.decode_timing([{"times": a}, {"times": b}])
    assert timing["first_gap_ms"]["p99"] == pytest.approx(50, rel=0.02)
    assert timing["later_step_join_ms"] == pytest.approx(
        {"samples": 1, "p50": 25.0, "p90": 25.0, "p99": 25.0})
    assert timing["later_step_alone_ms"]["samples"] == 16  # A: 0.05 .. 0.2 s; B: its last
    assert timing["later_step_alone_ms"]["p50"] == pytest.approx(10.0)
    assert timing["later_step_shared_ms"]["samples"] == 4
    assert timing["tpot_without_first_gap_ms"]["p50"] == pytest.approx(
        np.median([(0.249 - 0.05) / 18 * 1e3, 12.0]))
    # B sent at 0.15 s: A's five steps from then until B's first token ran beside its prefill.
    timing = module.decode_timing([{"times": a, "sent": 0.0}, {"times": b, "sent": 0.15}])
    assert timing["later_step_alone_beside_prefill_ms"]["samples"] == 5
    assert timing["later_step_alone_ms"]["samples"] == 11


def test_sharing_probe_sorts_steps_and_prompts_by_what_ran_beside_them():
    module = _script("validate_sim")
    window = module.STEP_WINDOW
    # An answer's first gap (its handoff, 50 ms) left out; then 1 ms steps for two windows
    # and 2 ms steps for two more: only windows wholly inside (start, end) count.
    times = [0.0, 0.05] + [0.05 + 0.001 * (i + 1) for i in range(2 * window)]
    times += [times[-1] + 0.002 * (i + 1) for i in range(2 * window)]
    assert module.sharing_steps(times, None) == pytest.approx([1e-3, 1e-3, 2e-3, 2e-3])
    inside = (0.05 + 0.001 * window, times[-1])
    assert module.sharing_steps(times, inside) == pytest.approx([1e-3, 2e-3, 2e-3])
    summary = module.sharing_summary(
        {"alone": [np.array([0.002, 0.002, 0.004])], "beside": [np.array([0.003, 0.003])]},
        {"alone": [(64, 0.01), (64, 0.03), (512, 0.1)], "beside": [(64, 0.03), (512, 0.15)]},
        context=300)
    assert summary["decode_step_ms_alone"]["p50"] == pytest.approx(2.0)
    assert summary["alone_first_steps_over_later"] == pytest.approx(0.002 / 0.003)
    assert summary["decode_step_ms_beside_prefill"]["p50"] == pytest.approx(3.0)
    assert summary["prefill_ms_alone"] == pytest.approx({"64": 20.0, "512": 100.0})
    # each beside its length's median alone: 1.5 and 1.5
    assert summary["prefill_beside_decode_over_alone"]["p50"] == pytest.approx(1.5)
    with pytest.raises(RuntimeError, match="sharing probe"):
        module.sharing_summary({"alone": [np.array([0.002])], "beside": [np.array([])]},
                               {"alone": [(64, 0.01)], "beside": [(64, 0.01)]}, context=300)


def test_held_stretches_from_the_probe_never_negative_nor_whole():
    module = _script("validate_sim")
    held = [module.held_stretches({"alone_step_lag_correlation": {"8_steps": c}})
            for c in (0.6, -0.3, None, 1.0)]
    assert held == [0.6, 0.0, 0.0, 0.99]


def test_lag_correlation_of_step_means_within_streams():
    module = _script("validate_sim")
    slow_then_fast = np.array([1.2, 1.2, 1.2, 0.8, 0.8, 0.8])
    assert module.lag_correlation([slow_then_fast]) == pytest.approx(2 / 3)
    alternating = np.array([1.2, 0.8] * 3)
    assert module.lag_correlation([alternating]) == pytest.approx(-1.0)
    assert module.lag_correlation([np.array([1.0, 1.1])]) is None  # one pair: nothing to say


def test_validation_runs_summarized_with_the_spread_of_each_error(tmp_path):
    module = _script("validate_sim")
    paths = []
    for i, error in enumerate((-0.05, 0.08)):
        row = {"measured": {"p50": 1.0, "p99": 2.0}, "simulated": {"p50": 1 + error, "p99": 2.0},
               "simulated_error": {"p50": error, "p99": 0.0}}
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"git_revision": "abc", "host_load_average_1min": {},
                                    "compare": {"ttft_s": row, "tpot_s": row}}))
        paths.append(str(path))
    # A later run with a simulation the earlier ones lack, and the drift it recorded.
    row = {**row, "simulated_calibrated_both_sides": {"p50": 1.2, "p99": 2.0},
           "simulated_calibrated_both_sides_error": {"p50": 0.2, "p99": 0.0}}
    path = tmp_path / "run2.json.gz"  # committed runs are kept gzip-compressed
    path.write_bytes(gzip.compress(json.dumps({
        "git_revision": "def", "compare": {"ttft_s": row, "tpot_s": row},
        "recalibration": {"drift": {"decode": 1.1}}}).encode()))
    paths.append(str(path))
    summary = module.summarize_runs(paths)
    assert list(summary["runs"]) == ["run0", "run1", "run2"]
    assert summary["runs"]["run2"]["drift_after_replay"] == {"decode": 1.1}
    assert summary["error_spread"]["tpot_s"]["simulated"] == {"p50": [-0.05, 0.08],
                                                               "p99": [0.0, 0.0]}
    assert summary["error_spread"]["tpot_s"]["simulated_calibrated_both_sides"] == {
        "p50": [0.2, 0.2], "p99": [0.0, 0.0]}
    # Without --out the summary goes to stdout, to read on the spot.
    printed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "validate_sim.py"),
                              "--summarize", *paths], check=True, cwd=ROOT, timeout=120,
                             capture_output=True, text=True).stdout
    assert json.loads(printed)["error_spread"] == summary["error_spread"]


def test_percentiles_of_several_draws_are_each_draw_s_then_their_median():
    """As the measured percentiles are over one replay's requests: per draw, then the
    median over draws; the pooled rows' beside."""
    module = _script("validate_sim")
    rows = [{"ttft_s": 5.0 if i == 0 else 1.0 + draw * 0.1 + i * 1e-3, "draw": draw}
            for draw in range(3) for i in range(100)]
    got = module.percentiles(rows, "ttft_s")
    each = [np.percentile([r["ttft_s"] for r in rows if r["draw"] == d], 99) for d in range(3)]
    assert got["p99"] == pytest.approx(np.median(each))
    assert got["pooled"]["p99"] == pytest.approx(np.percentile([r["ttft_s"] for r in rows], 99))
    # The slow request's three rows are the pooled top 1%: the P99 below them is the
    # slowest draw's next request, above the draws' median.
    assert got["pooled"]["p99"] > max(each[:2]) and got["p99"] == pytest.approx(each[1])
    plain = module.percentiles([{"ttft_s": 1.0}, {"ttft_s": 3.0}], "ttft_s")
    assert plain == {"p50": 2.0, "p99": pytest.approx(2.98)}


def test_points_from_both_sides_of_the_replay_are_pooled():
    """Prompt samples pooled per length, decode rounds pooled per point (the handoff as
    before); the drift is each kind's median of after over before."""
    module = _script("validate_sim")

    def prompts(*seconds):
        return [{"tokens": 64, "seconds": float(np.median(seconds)), "samples_s": list(seconds)}]

    before = {"prefill": prompts(0.10, 0.11, 0.12), "prefill_direct": prompts(0.08, 0.09),
              "decode": [{"batch": 1, "context": 100, "step_ms": 5.0,
                          "round_step_ms": [4.0, 5.0, 6.0], "streams": 3}],
              "handoff": [{"tokens": 64, "seconds": 0.01}]}
    after = {"prefill": prompts(0.13, 0.14, 0.15), "prefill_direct": prompts(0.10, 0.11),
             "decode": [{"batch": 1, "context": 110, "step_ms": 7.0,
                         "round_step_ms": [7.0], "streams": 1}]}
    pooled = module.bracketed(before, after)
    assert pooled["prefill"][0]["seconds"] == pytest.approx(0.125)
    assert pooled["prefill_direct"][0]["seconds"] == pytest.approx(0.095)
    assert pooled["decode"] == [{"batch": 1, "context": 105, "step_ms": 5.5,
                                 "round_step_ms": [4.0, 5.0, 6.0, 7.0], "streams": 4}]
    assert pooled["handoff"] == before["handoff"]
    assert module.drift(before, after) == pytest.approx(
        {"prefill": 0.14 / 0.11, "prefill_direct": 0.105 / 0.085, "decode": 7.0 / 5.0})


def _recorded_run(**extra) -> dict:
    """A recorded run's fields ``--resimulate`` reads: 1 ms per prompt token, 10 ms decode
    steps; a 50-token prompt, then a 200-token one 10 ms later."""
    model = {"prefill_per_token_s": 1e-3, "prefill_per_token_sq_s": 0.0,
             "decode_base_s": 0.01, "decode_per_request_s": 0.0, "decode_per_kv_token_s": 0.0,
             "kv_bytes_per_token": 0, "decode_kv_tokens": 100_000}
    measured = {"p50": 0.1, "p99": 0.2}
    return {"git_revision": "abc", "latency_model": model,
            "shared_cores": {"decode_slowdown": 1.0, "prefill_slowdown": 1.0},
            "service_ratios": {"prefill": [1.0], "decode_step": [1.0]},
            "decode_hold_probability": 0.0, "requests": [[0.0, 50, 3], [0.01, 200, 3]],
            "compare": {"ttft_s": {"measured": measured}, "tpot_s": {"measured": measured}},
            **extra}


def test_resimulation_of_a_recorded_run_with_its_prefill_steps(tmp_path):
    module = _script("validate_sim")
    args = SimpleNamespace(draws=2, seed=0, ttft_slo_s=2.0, max_wait_s=30.0, refit=False,
                           skip_prompt_rounds=0)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_recorded_run()))
    with pytest.raises(SystemExit, match="--assume-prefill-steps"):
        module.resimulate(str(path), args, None)
    result = module.resimulate(str(path), args, module.assumed_steps("100,late"))
    assert result["prefill_steps"] == {"chunk_tokens": 100, "tokens_one_step_late": True}
    ttft = result["compare"]["ttft_s"]
    # The first prompt comes back after the second's first piece: 150 ms, not 50.
    assert ttft["simulated_medians_only"]["p50"] == pytest.approx((0.15 + 0.24) / 2)
    assert ttft["simulated_without_prefill_steps"]["p50"] == pytest.approx((0.05 + 0.24) / 2)
    assert ttft["simulated_error"]["p99"] == pytest.approx(ttft["simulated"]["p99"] / 0.2 - 1)
    # Steps a run recorded are the ones it ran: an assumption does not replace them.
    path.write_text(json.dumps(_recorded_run(
        prefill_steps={"chunk_tokens": 100, "tokens_one_step_late": False})))
    result = module.resimulate(str(path), args, module.assumed_steps("100,late"))
    assert result["compare"]["ttft_s"]["simulated_medians_only"]["p50"] == pytest.approx(
        (0.05 + 0.24) / 2)
    with pytest.raises(Exception, match="CHUNK or CHUNK,late"):
        module.assumed_steps("512,early")


def test_resimulation_of_a_run_that_recorded_its_both_sides_model_as_the_model(tmp_path):
    """156c086-bcc1c68 recorded the model fitted to both sides of the replay as
    ``latency_model`` and the one fitted before as ``latency_model_before_replay``: re-
    simulated, the one before is the figures' and the both-sides one is simulated beside
    (here 2 ms per prompt token against 1: the 50-token prompt's first token 0.1 s)."""
    module = _script("validate_sim")
    args = SimpleNamespace(draws=2, seed=0, ttft_slo_s=2.0, max_wait_s=30.0, refit=False,
                           skip_prompt_rounds=0)
    run = _recorded_run(prefill_steps={"chunk_tokens": 512, "tokens_one_step_late": False},
                        requests=[[0.0, 50, 3]])
    before = {**run["latency_model"], "prefill_per_token_s": 2e-3}
    run["recalibration"] = {"drift": {}, "latency_model_before_replay": before}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    result = module.resimulate(str(path), args, None)
    assert result["latency_model"]["prefill_per_token_s"] == 2e-3
    ttft = result["compare"]["ttft_s"]
    assert ttft["simulated_medians_only"]["p50"] == pytest.approx(0.1)
    assert ttft["simulated_calibrated_both_sides"]["p50"] == pytest.approx(0.05)


def test_resimulation_takes_the_recorded_idle_extra(tmp_path):
    """A run that recorded the idle probe's extra is simulated with it: the first prompt
    (10 ms into the replay, idle since its start) pays 10 ms * 1/2 = 5 ms more; a run
    without it is simulated as before."""
    module = _script("validate_sim")
    args = SimpleNamespace(draws=1, seed=0, ttft_slo_s=2.0, max_wait_s=30.0, refit=False,
                           skip_prompt_rounds=0)
    steps = {"chunk_tokens": 512, "tokens_one_step_late": False}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_recorded_run(prefill_steps=steps, requests=[[0.01, 50, 3]])))
    plain = module.resimulate(str(path), args, None)["compare"]["ttft_s"]
    path.write_text(json.dumps(_recorded_run(prefill_steps=steps, requests=[[0.01, 50, 3]],
                                             idle_wake={"points": [[0.02, 0.01]]})))
    woken = module.resimulate(str(path), args, None)["compare"]["ttft_s"]
    assert plain["simulated_medians_only"]["p50"] == pytest.approx(0.05)
    assert woken["simulated_medians_only"]["p50"] == pytest.approx(0.055)
    assert woken["simulated_without_idle_wake"]["p50"] == pytest.approx(0.05)


def test_resimulation_draws_prompts_from_the_decode_steps_spread_beside(tmp_path):
    """Beside the prompts' own spread (here none: every prompt at its median), the same
    simulation with each prompt drawn from the decode steps' spread (here every block 1.5x
    its median): the 50-token prompt alone takes 50 ms, then 75."""
    module = _script("validate_sim")
    args = SimpleNamespace(draws=1, seed=0, ttft_slo_s=2.0, max_wait_s=30.0, refit=False,
                           skip_prompt_rounds=0)
    steps = {"chunk_tokens": 512, "tokens_one_step_late": False}
    run = _recorded_run(prefill_steps=steps, requests=[[0.0, 50, 3]],
                        service_ratios={"prefill": [1.0], "decode_step": [1.5]})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    ttft = module.resimulate(str(path), args, None)["compare"]["ttft_s"]
    assert ttft["simulated"]["p50"] == pytest.approx(0.05)
    assert ttft["simulated_with_prefill_host_spread"]["p50"] == pytest.approx(0.075)


def test_idle_extra_a_line_in_the_prompts_tokens_per_pause():
    """Per pause and length the median after the pause less the median back to back (64
    tokens: 5 ms more, 1,024: 13 ms more): through them 4.5 ms plus 8.3 us a token; a
    length never timed back to back gives nothing to compare."""
    module = _script("validate_sim")
    samples = [(64, 0.0, 0.020), (64, 0.0, 0.022), (64, 1.0, 0.026),
               (1024, 0.0, 0.150), (1024, 1.0, 0.163), (256, 1.0, 0.5)]
    ((pause, base, per_token),) = module.idle_wake_points(samples, [1.0])
    assert pause == 1.0
    assert per_token == pytest.approx(0.008 / 960)
    assert base == pytest.approx(0.005 - 64 * 0.008 / 960)
    with pytest.raises(RuntimeError, match="idle probe"):
        module.idle_wake_points(samples, [2.0])


def test_first_tokens_over_simulated_apart_beside_a_decode(tmp_path):
    """The second request arrives while the first decodes (0.06-0.08 s): its measured
    first token (125 ms) over the simulated (200 ms: 1 ms a token) counts beside a decode,
    the first's (60 ms over 50) with nothing decoding."""
    module = _script("validate_sim")
    args = SimpleNamespace(draws=1, seed=0, ttft_slo_s=2.0, max_wait_s=30.0, refit=False,
                           skip_prompt_rounds=0)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_recorded_run(
        prefill_steps={"chunk_tokens": 512, "tokens_one_step_late": False},
        requests=[[0.0, 50, 3], [0.075, 200, 3]],
        measured_token_times_s=[[0.06, 0.07, 0.08], [0.2, 0.21, 0.22]])))
    ratios = module.resimulate(str(path), args, None)["first_token_over_simulated"]
    assert ratios["nothing_decoding"]["50"]["median"] == pytest.approx(1.2)
    assert ratios["beside_decode"]["200"] == pytest.approx(
        {"requests": 1, "median": 0.625, "min": 0.625, "max": 0.625})


def test_idle_pauses_above_zero_and_rising():
    module = _script("validate_sim")
    assert module.rising_seconds("0.5,2") == [0.5, 2.0]
    for bad in ("0,1", "2,1", "1,1"):
        with pytest.raises(Exception, match="rising"):
            module.rising_seconds(bad)


def test_handoff_sample_takes_off_the_steps_its_chunk_carries():
    module = _script("validate_sim")
    # First token at 0.1 s; the next chunk, 30 ms later, carries two tokens (two 5 ms steps).
    times = [0.1, 0.13, 0.13, 0.135, 0.14, 0.145]
    assert module.handoff_sample(times) == pytest.approx(0.02)
    assert module.handoff_sample([0.1, 0.1, 0.13, 0.135]) is None  # no time of its own


def test_decode_timing_only_while_the_whole_batch_decodes():
    """The batch's prompts start one after another: steps before the last one's first token
    (prompt pieces in them under chunked prefill) and after the first one's last token
    (a smaller batch) are not the batch's decode step (at b249c95 they were, and a chunked
    instance's batch-32 step read 52 ms where whole-batch steps take ~18)."""
    module = _script("validate_sim")
    early = [0.0 + 0.05 * i for i in range(40)]  # mixed steps of 50 ms until 1.0 s ...
    early = [t for t in early if t < 1.0] + [1.0 + 0.01 * i for i in range(1, 100)]
    late = [1.0 + 0.01 * i for i in range(120)]  # ... then 10 ms steps, the batch together
    steps = module.steady_steps([early, late], 2, 64, 32)
    assert steps == pytest.approx(np.full(len(steps), 0.01))
    with pytest.raises(RuntimeError, match="raise --decode-steps"):
        module.steady_steps([early, [t + 0.9 for t in late]], 2, 64, 64)


def test_interference_steps_split_a_chunk_over_its_tokens():
    module = _script("sim_validate_instance")
    times = [0.0, 0.1, 0.1, 0.1, 0.2]  # the second chunk carried three tokens
    assert module.chunk_steps(times) == pytest.approx([(0.0, 0.1 / 3), (0.1, 0.1)])


def test_resimulation_refits_the_model_from_the_recorded_points(tmp_path):
    """``--refit``: the model fitted again from the run's service points by today's fit (a
    decode step of 4 ms + 1 ms per request where the run recorded a flat 10 ms), the
    recorded one kept beside; the replayed decode steps over both models."""
    module = _script("validate_sim")
    decode = [{"batch": b, "context": c, "step_ms": 4.0 + b, "round_step_ms": [4.0 + b],
               "streams": b} for b in (1, 2, 4) for c in (64, 1024)]
    prompts = [{"tokens": n, "seconds": 0.01 + 1e-3 * n, "samples_s": [0.01 + 1e-3 * n]}
               for n in (64, 256)]
    points = {"prefill": prompts, "prefill_direct": prompts, "decode": decode,
              "handoff": [{"tokens": n, "seconds": 0.002} for n in (64, 256)]}
    steps = {"prefill": {"fields": ["t"], "rows": []},
             "decode": {"fields": list(module.STEP_FIELDS), "rows": [
                 [0.1, "decode_only", 1, 100, 0, 10.0], [0.2, "decode_only", 2, 200, 0, 6.0],
                 [0.3, "mixed", 1, 100, 64, 30.0]]}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_recorded_run(
        prefill_steps={"chunk_tokens": 100, "tokens_one_step_late": False},
        service_points=points, replay_steps=steps, config={"link_gb_per_s": 3.0})))
    args = SimpleNamespace(draws=2, seed=0, ttft_slo_s=2.0, max_wait_s=30.0, refit=True,
                           skip_prompt_rounds=0, model="tiny", link_gb_per_s=1.5,
                           decode_kv_tokens=100_000)
    result = module.resimulate(str(path), args, None)
    assert result["refit"] is True
    assert result["latency_model"]["link_gb_per_s"] == 3.0  # the run's, not today's flag
    assert result["latency_model_recorded"]["decode_base_s"] == 0.01
    assert result["latency_model"]["decode_base_s"] == pytest.approx(0.004, abs=1e-9)
    assert result["latency_model"]["decode_per_request_s"] == pytest.approx(0.001)
    over = result["replay_decode_steps_over_model"]  # the mixed step left out
    assert over["recorded"]["steps"] == 2 and over["recorded"]["p50_by_batch"] == {
        "1": {"steps": 1, "p50": pytest.approx(1.0)}, "2": {"steps": 1, "p50": pytest.approx(0.6)}}
    assert over["refitted"]["p50_by_batch"]["1"]["p50"] == pytest.approx(10.0 / 5.0)
    assert over["refitted"]["p50_by_batch"]["2"]["p50"] == pytest.approx(6.0 / 6.0)
    # The decode steps simulated at the speed the decode engine ran them in the replay:
    # the median of its decode-only steps over the (refitted) model's, 2.0 and 1.0.
    assert result["replay_decode_engine_speed"] == pytest.approx(1.5)
    slowed = result["compare"]["tpot_s"]["simulated_at_replay_decode_engine_speed"]
    assert slowed["p50"] > result["compare"]["tpot_s"]["simulated"]["p50"]
    del points["handoff"]
    path.write_text(json.dumps(_recorded_run(
        prefill_steps={"chunk_tokens": 100, "tokens_one_step_late": False},
        service_points=points)))
    with pytest.raises(SystemExit, match="no handoff points"):
        module.resimulate(str(path), args, None)


def test_the_gateway_and_client_cores_keep_off_the_instances_cores(monkeypatch):
    module = _script("validate_sim")
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {3, 0, 1, 2})
    monkeypatch.setattr(module, "physical_core", str)  # no SMT
    args = SimpleNamespace(pin_cores=True, client_core="rest")
    assert module.instance_cores(args) == [{0}, {1}]
    assert module.client_cores(args) == {2, 3}
    assert module.client_cores(SimpleNamespace(pin_cores=True, client_core="prefill")) == {0}
    assert module.client_cores(SimpleNamespace(pin_cores=True, client_core="any")) is None
    assert module.client_cores(SimpleNamespace(pin_cores=False, client_core="rest")) is None
    # Hardware threads 0 and 2 share a core, as 1 and 3 do: the instances take 0 and 1,
    # and nothing is left for the gateway that shares neither.
    monkeypatch.setattr(module, "physical_core", lambda cpu: "0,2" if cpu % 2 == 0 else "1,3")
    assert module.instance_cores(args) == [{0}, {1}]
    with pytest.raises(SystemExit, match="needs a core beside"):
        module.client_cores(args)
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(module, "physical_core", lambda cpu: f"{cpu % 4},{cpu % 4 + 4}")
    assert module.instance_cores(args) == [{0}, {1}]
    assert module.client_cores(args) == {2, 3, 6, 7}
    monkeypatch.setattr(module, "physical_core", lambda cpu: f"{cpu // 2 * 2}-{cpu // 2 * 2 + 1}")
    assert module.instance_cores(args) == [{0}, {2}]
    assert module.client_cores(args) == {4, 5, 6, 7}


def test_validation_resimulated_without_first_prompt_rounds_drops_them_per_length():
    module = _script("validate_sim")
    run = {"service_points": {"prefill": [
               {"tokens": 64, "seconds": 0.03, "samples_s": [0.09, 0.02, 0.03, 0.04]},
               {"tokens": 256, "seconds": 0.1, "samples_s": [0.3, 0.1, 0.05, 0.2]}],
               "decode": [{"batch": 1}]},
           "service_ratios": {"prefill": [9.0], "decode_step": [1.0, 1.1]}}
    warm = module.without_first_prompt_rounds(run, 1)
    assert [p["samples_s"] for p in warm["service_points"]["prefill"]] == [
        [0.02, 0.03, 0.04], [0.1, 0.05, 0.2]]
    assert [p["seconds"] for p in warm["service_points"]["prefill"]] == [0.03, 0.1]
    assert warm["service_ratios"]["prefill"] == pytest.approx(
        [2 / 3, 1.0, 4 / 3, 1.0, 0.5, 2.0])
    assert warm["service_ratios"]["decode_step"] == [1.0, 1.1]  # decode untouched
    assert run["service_points"]["prefill"][0]["samples_s"][0] == 0.09  # a copy
    with pytest.raises(SystemExit, match="only 4 samples"):
        module.without_first_prompt_rounds(run, 4)
