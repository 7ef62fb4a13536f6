"""The multiplex step replay (``benchmarks/mux_step_replay.py``): a recorded probe's requests
through the real planner, step by step, with the committed d698fcb H200 profile."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_scripts import _load

ROOT = Path(__file__).resolve().parents[2]
PREDICTOR = ROOT / "benchmarks" / "results" / "loogle_h200" / "d698fcb_predictor.json"
SERVER_ARGS = ("--schedule multiplex --max-num-batched-tokens 24576 --mux-predictor p "
               "--itl-slo-ms 60 --mux-graph-step-tokens 256 --mux-mixed-floor-tokens 256")


@pytest.fixture(scope="module")
def tool():
    return _load("mux_step_replay")


@pytest.fixture(scope="module")
def predictor(tool):
    return tool.LatencyPredictor.load(PREDICTOR)


def record(count: int, gap_s: float, rate: float, prompt_len: int = 330,
           output_len: int = 40) -> dict:
    """A probe of ``count`` prompts, ``gap_s`` apart."""
    samples = [{"send_s": i * gap_s, "prompt_len": prompt_len, "output_tokens": output_len,
                "ttft_ms": 100.0, "tpot_ms": 30.0} for i in range(count)]
    return {"config": {"server_args": SERVER_ARGS}, "probe": {"rate": rate},
            "git_revision": "0" * 40, "samples": samples,
            "summary": {"slo": {"ttft_ms": 2000.0, "itl_ms": 60.0}, "slo_attainment": 1.0}}


def test_every_request_is_served_once_in_order_of_its_steps(tool, predictor):
    result = tool.replay(record(20, 0.5, 2.0), predictor)
    assert result["attainment"] == 1.0
    assert result["steps"]["prefill_only"] >= 1 and result["steps"]["decode_only"] > 0
    assert 0 < result["ttft_s"]["p50"] < 0.2  # one prompt alone: ~70 ms
    assert 0.015 < result["tpot_s"]["p50"] < 0.03  # a decode batch of 1-2


def test_the_client_sees_the_first_token_a_step_after_the_prompt_s_step(tool, predictor):
    """Overlap scheduling: a lone prompt's first token shows at the end of its first decode
    step, not of its prefill step (the floor512 ShareGPT-like probes' first requests came
    a decode step over a replay without it)."""
    lone = tool.replay(record(1, 1.0, 1.0), predictor)
    prefill = predictor.predict("prefill", 330, 0, 1, 132)
    decode = predictor.predict("decode", 1, 331, 1, 132)
    assert 1e3 * lone["ttft_s"]["p50"] == pytest.approx(prefill + decode, rel=0.02)


def test_the_replay_s_mixed_steps_are_set_beside_the_probe_s(tool, tmp_path):
    """Each replay's mixed-step times, and the measured ones from the probe's timeline."""
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(record(120, 0.06, 16.0, output_len=120)))
    timeline = [{"mode": "temporal", "measured_cycle_ms": float(ms)} for ms in range(1, 101)]
    timeline.append({"mode": "decode_only", "measured_cycle_ms": 500.0})
    with gzip.open(tmp_path / "probe_timeline.json.gz", "wt") as out:
        json.dump(timeline, out)
    out = tmp_path / "replay.json"
    tool.main(["--record", str(path), "--predictor", str(PREDICTOR), "--out", str(out)])
    result = json.loads(out.read_text())
    measured = result["measured"]["mixed_step_ms"]
    assert measured["steps"] == 100 and measured["p50"] == pytest.approx(50.5)
    replayed = result["replayed"][0]
    assert replayed["mixed_step_ms"]["steps"] == replayed["steps"]["temporal"] > 0
    assert 20 < replayed["mixed_step_ms"]["p50"] < 70


def test_a_higher_rate_rescales_the_arrivals(tool, predictor):
    base = record(60, 0.05, 20.0)
    calm = tool.replay(base, predictor, rate=5.0)
    busy = tool.replay(base, predictor, rate=40.0)
    assert (calm["rate"], busy["rate"]) == (5.0, 40.0)
    assert busy["ttft_s"]["p99"] > calm["ttft_s"]["p99"]
    assert busy["busy_s"] < calm["busy_s"] * 1.5  # the same work, packed closer


def test_ttft_pressure_drains_an_overloaded_queue_faster(tool, predictor):
    # 10K prompt tokens/s beside ~100 decodes: more than mixed steps within 54 ms take.
    overloaded = record(100, 0.1, 10.0, prompt_len=1000, output_len=100)
    unpressed = tool.replay(overloaded, predictor, "--ttft-slo-ms 2000")
    pressed = tool.replay(overloaded, predictor,
                          "--ttft-slo-ms 2000 --mux-ttft-pressed-margin 1")
    assert pressed["ttft_s"]["p99"] < unpressed["ttft_s"]["p99"]
    assert pressed["tpot_s"]["p99"] > unpressed["tpot_s"]["p99"]  # paid in TPOT
    assert pressed["tpot_s"]["p99"] <= 0.0605  # within the target it plans to


def test_a_replay_at_the_probe_s_rate_sets_its_ttft_beside_the_measured_per_send_window(
        tool, predictor):
    """40 prompts 0.1 s apart (2 s windows of 20 requests), each measured at 100 ms."""
    probe = record(40, 0.1, 10.0)
    windows = tool.replay(probe, predictor)["ttft_by_send_window"]
    assert windows["window_start_s"] == [0.0, 2.0] and windows["requests"] == [20, 20]
    assert windows["measured_p50_s"] == [0.1, 0.1]
    assert all(0 < s < 0.2 for s in windows["replayed_p50_s"])  # a prompt alone: ~70 ms
    # Overloaded (20K prompt tokens/s), the later window's prompts queue behind the
    # earlier's, whatever the probe measured.
    crowded = tool.replay(record(40, 0.1, 10.0, prompt_len=2000), predictor)
    early, late = crowded["ttft_by_send_window"]["replayed_p50_s"]
    assert late > early + 0.5
    # At another rate the requests are not the probe's: no windows.
    assert "ttft_by_send_window" not in tool.replay(probe, predictor, rate=5.0)


def test_the_planner_follows_the_command_line_and_the_variant(tool):
    config = tool.planner_config(SERVER_ARGS, "--mux-tpot-bank-cap 3 --itl-slo-ms 80")
    assert (config.itl_slo_ms, config.tpot_bank_cap) == (80.0, 3.0)
    assert (config.graph_step_tokens, config.mixed_floor_tokens) == (256, 256)
    assert not config.spatial and not config.time_slice and config.temporal


def test_the_script_writes_a_prediction_beside_the_measured_figures(tool, tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(record(10, 0.5, 2.0)))
    out = tmp_path / "replay.json"
    tool.main(["--record", str(path), "--predictor", str(PREDICTOR), "--rates", "2,4",
               "--variant", "--mux-tpot-bank-cap 2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "prediction"
    assert result["measured"]["attainment"] == 1.0
    assert [(r["rate"], r["variant"]) for r in result["replayed"]] == [
        (2.0, ""), (2.0, "--mux-tpot-bank-cap 2"), (4.0, ""), (4.0, "--mux-tpot-bank-cap 2")]


def test_a_record_replays_with_the_fit_today_s_engine_makes_when_asked(tool, tmp_path):
    """``--fit today``: the profile refitted as a rerun's engine loads it (here with the GEMM
    tile steps the saved format-3 fit lacks), so the same steps take other times."""
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(record(10, 0.5, 2.0, prompt_len=3000)))
    steps = {}
    for fit in ("saved", "today"):
        out = tmp_path / f"{fit}.json"
        tool.main(["--record", str(path), "--predictor", str(PREDICTOR), "--fit", fit,
                   "--out", str(out)])
        result = json.loads(out.read_text())
        assert result["config"]["predictor_fit"] == fit
        steps[fit] = result["replayed"][0]["mixed_step_ms"]
    assert steps["saved"]["steps"] > 0 and steps["saved"] != steps["today"]
    with pytest.raises(SystemExit):  # a validation replays its engine's own fit
        tool.main(["--validation", str(path), "--fit", "today", "--out", str(tmp_path / "v")])


def test_a_validation_run_s_multiplex_replay_is_set_beside_its_measured_requests(tool, tmp_path):
    """The 8ccd9ac H200 validation ran whole-GPU steps only: replayed from the engine's
    corrections before that replay, TTFT comes within 10-11% at P50 and P99 (a regression
    guard on the model, as committed), TPOT P50 ~19% over."""
    validation = ROOT / "benchmarks" / "results" / "sim_validate_instance_h200_8ccd9ac.json"
    out = tmp_path / "v.json"
    tool.main(["--validation", str(validation), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "validation" and result["requests"] == 73
    assert "--mux-graph-step-tokens 256 --mux-mixed-floor-tokens 256" in result["server_args"]
    ttft = result["compare"]["ttft_s"]["engine_calibration_error"]
    tpot = result["compare"]["tpot_s"]["engine_calibration_error"]
    assert abs(ttft["p50"]) < 0.11 and abs(ttft["p99"]) < 0.11
    assert 0.1 < tpot["p50"] < 0.3
    assert set(result["steps"]) == {"engine_calibration", "engine_calibration_after_replay"}


def test_a_validation_is_replayed_with_the_fit_its_engine_planned_with(tool):
    """The 8ccd9ac engine's first prompt prefilled alone, then its first token decoded beside
    the next prompt's first chunk: the fit saved in the profile gives both predictions as the
    engine recorded them (its corrections are over these); the file refitted does not."""
    timeline = tool.load_timeline(ROOT / "benchmarks" / "results" /
                                  "sim_validate_instance_h200_8ccd9ac_multiplex_timeline_replay.json.gz")
    alone, mixed = timeline[0], timeline[1]
    piece = ("prefill", alone["prefill_tokens"], 0, 1, 132, False, alone["prefill_layers"])
    served = tool.served_predictor(PREDICTOR)
    assert served.predict(*piece) == pytest.approx(alone["predicted_piece_ms"], rel=1e-12)
    context = alone["prefill_tokens"] + 1  # the prompt and its first token
    step = served.predict_mixed(mixed["prefill_tokens"], 0, 1, mixed["decode_batch"], context)
    assert step * mixed["calibration"] == pytest.approx(mixed["predicted_cycle_ms"], rel=1e-12)
    refitted = tool.LatencyPredictor.load(PREDICTOR)
    assert refitted.predict(*piece) != pytest.approx(alone["predicted_piece_ms"], rel=1e-3)


def test_eager_steps_slower_than_profiled_cost_attainment_and_are_learned(tool, predictor):
    # ~10K prompt tokens/s arriving beside a growing decode batch: near the knee, eager steps
    # 15% over the profile leave prompts waiting, and the correction learns the 15%.
    busy = record(120, 0.06, 16.0, prompt_len=330, output_len=120)
    as_profiled = tool.replay(busy, predictor, eager=tool.EagerSteps(1.0, 1.0))
    slower = tool.replay(busy, predictor, eager=tool.EagerSteps(1.15, 1.0))
    assert slower["ttft_s"]["p99"] > as_profiled["ttft_s"]["p99"]
    assert slower["eager_correction_after"] > 1.1
    assert as_profiled["eager_correction_after"] == pytest.approx(1.0, abs=0.01)
    # A stale correction from a slow start comes back down once eager steps run as profiled.
    stale = tool.replay(busy, predictor, eager=tool.EagerSteps(1.0, 1.2))
    assert stale["eager_correction_after"] < 1.05
    assert stale["eager"] == {"factor": 1.0, "start_correction": 1.2}


def _twin(tmp_path: Path, decode_ratio_by_batch) -> Path:
    """A twin run's record and timeline: its decode-only steps at ``decode_ratio_by_batch``
    (batch -> measured over predicted), its mixed steps as predicted."""
    timeline = [{"time": 0.01 * batch, "mode": "decode_only", "decode_batch": batch,
                 "predicted_cycle_ms": 20.0,
                 "measured_device_ms": 20.0 * decode_ratio_by_batch(batch), "calibration": 1.0}
                for batch in range(1, 201)]
    timeline += [{"time": 3.0, "mode": "temporal", "decode_batch": 8,
                  "predicted_cycle_ms": 40.0, "measured_device_ms": 40.0, "calibration": 1.0}]
    path = tmp_path / "twin.json"
    path.write_text(json.dumps({"calibration_after": {"mixed_steps": 1.0,
                                                      "graph_mixed_steps": 1.0}}))
    with gzip.open(tmp_path / "twin_timeline.json.gz", "wt") as out:
        json.dump(timeline, out)
    return path


def test_a_twin_run_s_decode_times_are_drawn_by_batch(tool, predictor, tmp_path):
    """Decode alone slower only beyond 100 requests: a probe whose batch stays small keeps
    its TPOT; one whose batch grows past 100 pays it."""
    twin = tool.Twin.load(_twin(tmp_path, lambda batch: 1.0 if batch <= 100 else 1.5))
    assert [ratio for batch, ratio in twin.spread.decode_by_batch if batch > 100] == [1.5] * 100
    small = record(20, 0.5, 2.0)
    large = record(150, 0.01, 100.0, prompt_len=64, output_len=200)
    as_profiled = tool.replay(large, predictor)
    for probe, slower in ((small, False), (large, True)):
        timed = tool.replay(probe, predictor, twin=twin, seed=1)
        assert timed["seed"] == 1
        plain = tool.replay(probe, predictor)
        assert (timed["tpot_s"]["p50"] > 1.2 * plain["tpot_s"]["p50"]) == slower
    assert as_profiled["tpot_s"]["p50"] < tool.replay(large, predictor, twin=twin)["tpot_s"]["p50"]


def _graph_twin(tmp_path, predictor, ratio_by_batch) -> Path:
    """A twin run whose mixed steps on the graphs (32 prompt tokens beside 1-200 decodes)
    took ``ratio_by_batch(batch)`` times the profile's time."""
    timeline = []
    for batch in range(1, 201):
        profile = predictor.predict_mixed(32, 0, 1, batch, 100 * batch)
        timeline.append({"time": 1.0, "mode": "temporal", "decode_batch": batch,
                         "prefill_tokens": 32, "prefill_context_tokens": 0,
                         "prefill_pieces": [[0, 32]], "decode_context_tokens": 100 * batch,
                         "predicted_cycle_ms": profile,
                         "measured_device_ms": profile * ratio_by_batch(batch)})
    timeline += [{"time": 2.0, "mode": "decode_only", "decode_batch": batch,
                  "predicted_cycle_ms": 20.0, "measured_device_ms": 20.0, "calibration": 1.0}
                 for batch in range(1, 201)]  # decode alone at the profile's time
    path = tmp_path / "graph_twin.json"
    path.write_text(json.dumps({"config": {"server_args": SERVER_ARGS},
                                "calibration_after": {"mixed_steps": 1.0,
                                                      "graph_mixed_steps": 1.3}}))
    with gzip.open(tmp_path / "graph_twin_timeline.json.gz", "wt") as out:
        json.dump(timeline, out)
    return path


def test_a_twin_run_s_graph_steps_are_drawn_by_decode_batch(tool, predictor, tmp_path):
    """Graph mixed steps at the profile's time beside up to 100 decodes and 1.5x beyond,
    where the twin's engine learned one factor between (1.3): with the predictor, a
    replay whose mixed steps run beside small batches takes them at the profile's time,
    not at the factor; without it, the factor as before."""
    path = _graph_twin(tmp_path, predictor, lambda batch: 1.0 if batch <= 100 else 1.5)
    by_batch = tool.Twin.load(path, predictor)
    pairs = by_batch.spread.graph_mixed_by_batch
    assert [b for b, _ in pairs] == list(range(1, 201))
    assert [round(r, 6) for _, r in pairs] == [1.0] * 100 + [1.5] * 100
    assert tool.Twin.load(path).spread.graph_mixed_by_batch == ()
    small = record(40, 0.1, 10.0, prompt_len=200, output_len=40)  # a few decodes beside
    plain = tool.replay(small, predictor)["mixed_step_ms"]["p50"]
    drawn = tool.replay(small, predictor, twin=by_batch)["mixed_step_ms"]["p50"]
    factor = tool.replay(small, predictor, twin=tool.Twin.load(path))["mixed_step_ms"]["p50"]
    assert drawn == pytest.approx(plain, rel=0.05)
    assert factor > 1.2 * plain


def test_the_script_takes_a_twin_run_s_timing_over_seeds(tool, tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(record(10, 0.5, 2.0)))
    out = tmp_path / "replay.json"
    twin = _twin(tmp_path, lambda batch: 1.1)
    tool.main(["--record", str(path), "--predictor", str(PREDICTOR), "--spread-from",
               str(twin), "--seeds", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [row["seed"] for row in result["replayed"]] == [0, 1, 2]
    assert result["config"]["seeds"] == 3 and result["config"]["spread_from"].endswith("twin.json")
    with pytest.raises(SystemExit, match="one timing at a time"):
        tool.main(["--record", str(path), "--predictor", str(PREDICTOR), "--spread-from",
                   str(twin), "--eager-factor", "1.2", "--out", str(out)])


def test_a_validation_draws_graph_steps_by_batch_only_when_asked(tool, tmp_path):
    """The 6b7fcf7 validation replayed with its own replay timeline as the engine timing:
    its mixed steps on the prefill-step graphs (512 tokens) come by decode batch over the
    profile unless ``--no-graph-steps-by-batch`` says one learned factor."""
    results = ROOT / "benchmarks" / "results"
    validation = results / "sim_validate_instance_h200_6b7fcf7.json"
    spread = results / "sim_validate_instance_h200_6b7fcf7_multiplex_timeline_replay.json.gz"
    figures = {}
    for flag in ("--graph-steps-by-batch", "--no-graph-steps-by-batch"):
        out = tmp_path / f"{flag}.json"
        tool.main(["--validation", str(validation), "--spread-from", str(spread), flag,
                   "--out", str(out)])
        result = json.loads(out.read_text())
        figures[flag] = (result["config"]["graph_steps_by_batch"],
                         result["engine_timed"]["compare"]["ttft_s"]["simulated"]["p50"])
    assert figures["--graph-steps-by-batch"][0] is True
    assert figures["--no-graph-steps-by-batch"][0] is False
    assert figures["--graph-steps-by-batch"][1] != figures["--no-graph-steps-by-batch"][1]


def test_a_loogle_h200_row_replays_as_a_probe(tool, tmp_path):
    """loogle_h200.py's rows keep their requests in a records file beside them; the replay
    reads the server's flags after ``serve <model>``, TPOT over the tokens after the first."""
    requests = [{"i": i, "input_len": 330, "sent_at": 0.5 * i, "ok": True, "ttft": 0.1,
                 "e2e": 0.1 + 39 * 0.03, "output_len": 40} for i in range(20)]
    row = {"config": "multiplex", "rate": 2.0, "git_revision": "0" * 7, "attainment": 1.0,
           "server_command": f"python -m pdserve serve codellama-34b {SERVER_ARGS} "
                             "--load-format dummy",
           "engine_info": {"predictor": {"path": str(PREDICTOR)}}}
    path = tmp_path / "multiplex_rate2.0.json"
    path.write_text(json.dumps(row))
    (tmp_path / "multiplex_rate2.0_records.json").write_text(json.dumps(
        {"summary": {}, "requests": requests}))
    probe = tool.load_probe(path)
    assert probe["config"]["server_args"] == f"{SERVER_ARGS} --load-format dummy"
    assert probe["samples"][3]["send_s"] == 1.5
    assert probe["samples"][0]["tpot_ms"] == pytest.approx(30.0)
    out = tmp_path / "replay.json"
    tool.main(["--record", str(path), "--out", str(out)])  # its predictor from the row
    replayed = json.loads(out.read_text())["replayed"][0]
    assert replayed["attainment"] == 1.0 and replayed["rate"] == 2.0

