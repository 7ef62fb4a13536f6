"""Multiplexing as whole-GPU planner steps (``pdserve/sim/mux_steps.py``): engine timing,
the corrections learning from it, the first token a step late, and what the committed
8ccd9ac H200 replay timeline says of the model."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pdserve.sched.mux_planner import MuxPlanner, OnlineCalibration
from pdserve.sched.predictor import LatencyPredictor
from pdserve.sched.prefill_order import PrefillOrder
from pdserve.sim.mux_steps import (
    MuxStepSim,
    StepRequest,
    StepSpread,
    StepTiming,
    correction_trajectory,
    engine_timed,
    nearest_batch_ratios,
    slice_spread,
    step_spread,
    timeline_accuracy,
    timeline_stalls,
    timeline_steps_by_kind,
    whole_gpu_only,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PREDICTOR = RESULTS / "loogle_h200" / "d698fcb_predictor.json"
VALIDATION = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
TIMELINE = RESULTS / "sim_validate_instance_h200_8ccd9ac_multiplex_timeline_replay.json.gz"
HELD_OUT_TIMELINE = RESULTS / "sim_validate_instance_h200_7dad880_multiplex_timeline_replay.json.gz"
# The engine's planner at 8ccd9ac (the TPOT bank off, as it was by default then).
SERVER_ARGS = ("--schedule multiplex --itl-slo-ms 60 --mux-predictor p "
               "--mux-graph-step-tokens 256 --mux-mixed-floor-tokens 256 --mux-tpot-bank-cap 0")


def _script(name: str):
    """A script of benchmarks/ as a module (its GPU paths are not for CI)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def replay_tool():
    return _script("mux_step_replay")


@pytest.fixture(scope="module")
def predictor():
    return LatencyPredictor.load(PREDICTOR)


@pytest.fixture(scope="module")
def timeline():
    with gzip.open(TIMELINE, "rt") as f:
        return json.load(f)


def _requests(count: int = 24, gap_s: float = 0.25) -> list[StepRequest]:
    """Prompts of 2-6K tokens arriving faster than mixed steps beside them drain."""
    return [StepRequest(i * gap_s, 2048 + 1024 * (i % 5), 60) for i in range(count)]


def _sim(replay_tool, predictor, timing=None, lag=False, mixed=1.0, graph=1.0):
    calibration = OnlineCalibration(predictor)
    calibration.mixed_correction, calibration.graph_mixed_correction = mixed, graph
    planner = MuxPlanner(calibration, [], replay_tool.planner_config(SERVER_ARGS))
    requests = _requests()
    sim = MuxStepSim(planner, requests, timing, first_token_lag=lag)
    sim.run()
    return sim, requests


def _times(requests):
    return [(r.first_token, r.finished) for r in requests]


def test_engine_timing_at_the_corrections_in_force_is_the_planned_replay(replay_tool,
                                                                          predictor):
    # Each step then takes its prediction and teaches a ratio of 1: nothing moves.
    planned, planned_requests = _sim(replay_tool, predictor, mixed=1.05, graph=0.95)
    timed, timed_requests = _sim(replay_tool, predictor, StepTiming(0.95, 1.05),
                                 mixed=1.05, graph=0.95)
    assert _times(timed_requests) == pytest.approx(_times(planned_requests))
    assert timed.planner.calibration.mixed_correction == pytest.approx(1.05)
    assert timed.log.steps == planned.log.steps
    assert sum(timed.log.seconds.values()) == pytest.approx(timed.busy_s)


def test_slow_eager_steps_teach_the_correction_and_the_planner_turns_to_graph_steps(
        replay_tool, predictor):
    even, _ = _sim(replay_tool, predictor, StepTiming(1.0, 1.0))
    slow, _ = _sim(replay_tool, predictor, StepTiming(1.0, 1.2))
    assert even.log.steps.get("eager", 0) > even.log.steps.get("graph", 0)
    assert slow.planner.calibration.mixed_correction > 1.1  # learned, as the engine does
    assert slow.log.steps.get("graph", 0) > slow.log.steps.get("eager", 0)


def test_tokens_show_a_step_late_while_the_engine_runs_as_before(replay_tool, predictor):
    prompt, lagged = _sim(replay_tool, predictor), _sim(replay_tool, predictor, lag=True)
    assert lagged[0].log.steps == prompt[0].log.steps  # the same steps, seen later
    first = [r.first_token - r.arrival for r in prompt[1]]
    late = [r.first_token - r.arrival for r in lagged[1]]
    assert late[0] > first[0]  # the next prompt's step followed it
    assert all(b >= a for a, b in zip(first, late, strict=True))
    assert [r.sampled for r in lagged[1]] == [r.first_token for r in prompt[1]]
    last = max(lagged[1], key=lambda r: r.finished)
    assert last.finished == max(r.finished for r in prompt[1])  # nothing after: at once


def test_the_rebuilt_graph_correction_ends_where_the_engine_reported_it(timeline):
    calibration = json.loads(VALIDATION.read_text())["schedules"]["multiplex"]["interference"]
    before = calibration["engine_calibration"]
    start = (before["mixed_steps"], before["graph_mixed_steps"])
    trajectory = correction_trajectory(timeline, start, 256)
    assert trajectory[0] == (0.0, *start)  # the first decision, a prefill alone
    after = calibration["engine_calibration_after_replay"]
    assert trajectory[-1][1:] == pytest.approx(
        (after["mixed_steps"], after["graph_mixed_steps"]), abs=2e-4)


def test_the_timeline_s_steps_by_kind_add_up_to_its_own_summary(timeline):
    summary = json.loads(VALIDATION.read_text())["schedules"]["multiplex"][
        "interference"]["timeline_replay"]["decode_cycle"]
    by_kind = timeline_steps_by_kind(timeline, 256)["steps"]
    assert by_kind["graph"] + by_kind["eager"] == summary["temporal"]["n"]
    assert by_kind["decode_only"] == summary["decode_only"]["n"]
    assert whole_gpu_only(timeline)


def test_the_engine_s_corrected_steps_were_right_and_the_profile_erred_per_path(timeline):
    """The finding the step model rests on: every kind of step took its corrected
    prediction (median within 2%), while the profile alone had graph steps dear and eager
    ones cheap: the corrections per path carry that difference."""
    before = json.loads(VALIDATION.read_text())["schedules"]["multiplex"][
        "interference"]["engine_calibration"]
    trajectory = correction_trajectory(
        timeline, (before["mixed_steps"], before["graph_mixed_steps"]), 256)
    accuracy = timeline_accuracy(timeline, trajectory, 256)
    assert set(accuracy) == {"graph", "eager", "decode_only"}
    for kind in accuracy.values():
        assert kind["over_corrected_p50"] == pytest.approx(1.0, abs=0.02)
    assert accuracy["graph"]["over_profile_total"] < 0.95
    assert accuracy["eager"]["over_profile_total"] > 1.0


def test_stalls_and_spread_come_from_the_recorded_device_times(timeline):
    stalls = timeline_stalls(timeline, 3.0)
    slow = [e for e in timeline if e["predicted_cycle_ms"] > 0
            and e["measured_device_ms"] > 3.0 * e["predicted_cycle_ms"]]
    assert len(stalls) == len(slow) >= 1
    with gzip.open(HELD_OUT_TIMELINE, "rt") as f:
        held_out = json.load(f)
    spread = step_spread(held_out, "7dad880")
    assert not whole_gpu_only(held_out)  # that engine ran time slices too
    assert len(spread.mixed) == sum(1 for e in held_out if e["mode"] == "temporal"
                                    and e["measured_device_ms"] > 0)
    assert 0.95 < sorted(spread.mixed)[len(spread.mixed) // 2] < 1.05


def test_the_8ccd9ac_replay_against_the_step_model(replay_tool, tmp_path):
    """Given the corrections the engine held over its replay and its one stall, the step
    model lands within 10% on all four figures; from the corrections after the probes
    (engine timing) the planner keeps eager steps the engine left after 24.5 s."""
    out = tmp_path / "v.json"
    replay_tool.main(["--validation", str(VALIDATION), "--spread-from",
                      str(HELD_OUT_TIMELINE), "--seeds", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    diagnosis = result["diagnosis"]["compare"]
    for key in ("ttft_s", "tpot_s"):
        for q in ("p50", "p99"):
            assert abs(diagnosis[key]["trajectory_and_stalls_error"][q]) < 0.10
    timed = result["engine_timed"]
    assert timed["within_10_percent"]["ttft_s"] == {"p50": True, "p99": True}
    simulated = timed["steps_by_kind"]["steps"]
    measured = result["diagnosis"]["measured_steps_by_kind"]["steps"]
    assert simulated["eager"] > simulated["graph"] and measured["graph"] > measured["eager"]


def test_the_validation_script_simulates_the_step_model_beside_the_walk():
    """``sim_validate_instance.py`` runs the step model where the schedule has a fitted
    predictor, and says whether the engine ran only what the model has."""
    module = _script("sim_validate_instance")
    recorded = json.loads(VALIDATION.read_text())
    run = recorded["schedules"]["multiplex"]
    args = module.argparse.Namespace(**recorded["config"])
    requests, _ = module.window_requests(args, module.LatencyModel(**run["latency_model"]))
    rows = module.simulated_steps(run["schedule_args"], run["interference"], requests)
    assert len(rows) == len(requests) == len(run["measured_per_request"])
    measured = run["compare"]["ttft_s"]["measured"]["p50"]
    simulated = sorted(row["ttft_s"] for row in rows)[len(rows) // 2]
    assert simulated == pytest.approx(measured, rel=0.10)
    assert module.simulated_steps("--schedule multiplex --mux-predictor roofline",
                                  run["interference"], requests) is None
    assert module.steps_cover(run["interference"]) == {"engine_ran_whole_gpu_steps_only": True}
    held_out = json.loads((RESULTS / "sim_validate_instance_h200_7dad880.json").read_text())
    interference = held_out["schedules"]["multiplex"]["interference"]
    assert module.steps_cover(interference)["engine_ran_whole_gpu_steps_only"] is False
    assert module.steps_cover({}) == {"engine_ran_whole_gpu_steps_only": None}


def test_the_validation_script_times_the_step_model_by_the_probes_steps_too():
    """Given the engine's decisions over its probes, the step model's steps take the probes'
    measured over profile times, graph steps by decode batch, in several draws. Fed the
    6b7fcf7 replay's own decisions (in-sample, a check of the plumbing, not of the model),
    its TTFT lands where the replay measured it, which the one correction after the probes
    (+21% at P50) does not."""
    module = _script("sim_validate_instance")
    recorded = json.loads((RESULTS / "sim_validate_instance_h200_6b7fcf7.json").read_text())
    run = recorded["schedules"]["multiplex"]
    args = module.argparse.Namespace(**recorded["config"])
    requests, _ = module.window_requests(args, module.LatencyModel(**run["latency_model"]))
    timeline = module.load_timeline(
        RESULTS / "sim_validate_instance_h200_6b7fcf7_multiplex_timeline_replay.json.gz")
    simulated = module.with_step_model({}, run["schedule_args"], run["interference"],
                                       requests, timeline)
    timed = simulated["simulated_steps_probe_timing"]
    assert len(timed) == module.PROBE_TIMING_DRAWS * len(requests)
    measured = run["compare"]["ttft_s"]["measured"]["p50"]
    median = lambda rows: sorted(r["ttft_s"] for r in rows)[len(rows) // 2]
    assert median(timed) == pytest.approx(measured, rel=0.05)
    assert median(simulated["simulated_steps"]) > 1.15 * measured
    assert "simulated_steps_probe_timing" not in module.with_step_model(
        {}, run["schedule_args"], run["interference"], requests)


def test_the_5d0f7fe_replay_timed_by_its_own_probes_is_within_10_percent():
    """Out of sample: re-simulated offline, the step model timed by the probes' steps
    committed beside the 5d0f7fe validation (none of the replay's) comes within 10% of the
    replay's measured TTFT and TPOT, P50 and P99. With each batch drawing one end of a
    ratio-sorted slice the same run read +26% on TTFT P99."""
    module = _script("sim_validate_instance")
    path = RESULTS / "sim_validate_instance_h200_5d0f7fe.json"
    row = module.resimulate(str(path))["schedules"]["multiplex"]
    for metric in ("ttft_s", "tpot_s"):
        errors = row[metric]["simulated_steps_probe_timing_error"]
        assert abs(errors["p50"]) < 0.10 and abs(errors["p99"]) < 0.10, (metric, errors)


# --------------------------------------------------------------- time slices

SLICING_ARGS = ("--schedule multiplex --itl-slo-ms 60 --mux-predictor p "
                "--mux-sharing temporal,time_slice,spatial")


def _slicing_sim(replay_tool, predictor, pieces: tuple[float, float], start: float,
                 rule: str = "", timing: bool = True):
    """Prompts of 4-8K tokens beside a few decodes, time slices allowed, the time-slice
    correction starting at ``start``; every cycle at ``pieces`` (cycle, piece) of its
    profiled time."""
    server_args = f"{SLICING_ARGS} {rule}"
    calibration = replay_tool.calibrated(
        predictor, {"prefill_pieces": {"time_slice": {"correction": start, "pieces": 1}}},
        server_args)
    planner = MuxPlanner(calibration, [], replay_tool.planner_config(server_args,
                                                                     time_slice=True))
    requests = [StepRequest(i * 0.6, 4096 + 1024 * (i % 5), 80) for i in range(30)]
    steps = StepTiming(1.0, 1.0, slice_spread=(pieces,)) if timing else None
    sim = MuxStepSim(planner, requests, steps, first_token_lag=True)
    sim.run()
    return sim, requests


def test_the_planner_config_takes_time_slices_only_when_asked_and_the_server_allows(
        replay_tool):
    assert not replay_tool.planner_config(SLICING_ARGS).time_slice
    assert replay_tool.planner_config(SLICING_ARGS, time_slice=True).time_slice
    temporal = f"{SLICING_ARGS} --mux-sharing temporal,spatial"
    assert not replay_tool.planner_config(temporal, time_slice=True).time_slice
    assert not replay_tool.planner_config(SLICING_ARGS, time_slice=True).spatial


def test_a_record_replays_the_sharing_and_prefill_rule_it_ran_not_todays_defaults(
        replay_tool):
    """Records name neither flag where they ran the defaults of their day: the engine info
    says what ran; a record without it ran the defaults before time slices became opt-in."""
    def record(args: str, engine: dict) -> dict:
        return {"config": {"server_args": args, "engine": engine}}

    reported = record("--schedule multiplex", {"sharing": ["spatial", "temporal", "time_slice"],
                                               "calibration": {"prefill_rule": "compounding"}})
    config = replay_tool.planner_config(replay_tool.record_server_args(reported),
                                        time_slice=True, spatial=True)
    assert config.time_slice and config.spatial
    assert replay_tool.scheduler_config(replay_tool.record_server_args(reported)
                                        ).mux_prefill_correction == "compounding"
    unreported = replay_tool.record_server_args(record("--schedule multiplex", {}))
    assert replay_tool.planner_config(unreported, time_slice=True).time_slice
    named = record("--schedule multiplex --mux-sharing temporal "
                   "--mux-prefill-correction delivery", {"sharing": ["temporal"]})
    args = replay_tool.record_server_args(named)
    assert not replay_tool.planner_config(args, time_slice=True).time_slice
    assert replay_tool.scheduler_config(args).mux_prefill_correction == "delivery"
    today = replay_tool.planner_config("--schedule multiplex", time_slice=True)
    assert not today.time_slice  # time slices are opt-in now


def test_time_slice_cycles_serve_every_prompt_through_its_last_piece(replay_tool, predictor):
    sim, requests = _slicing_sim(replay_tool, predictor, (1.0, 1.0), 0.5, timing=False)
    assert sim.log.steps["time_slice"] > 100
    assert sum(sim.log.seconds.values()) == pytest.approx(sim.busy_s)
    for r in requests:
        assert r.prefilled == r.prompt_len and r.decoded + 1 == r.output_len
        assert r.arrival < r.sampled <= r.first_token < r.finished
    # The last piece's output is not overlapped: seen when it ends (but the first
    # prompt's, prefilled alone before any decode ran).
    assert sum(r.first_token == r.sampled for r in requests) == len(requests) - 1
    # A prompt prefilled in pieces beside decodes takes longer than alone on the GPU.
    alone = predictor.predict("prefill", 4096, 0, 1, predictor.total_sms)
    assert min(r.first_token - r.arrival for r in requests) > alone / 1e3


def test_compounding_pieces_under_the_profile_keep_slicing_over_it_they_stop(
        replay_tool, predictor):
    """The compounding rule moves the correction by each piece over its uncorrected cycle:
    pieces at 0.98 hold it at its 0.5 bound and the planner slices throughout (7dad880's
    first 32 s); at 1.04 it climbs, the rate the option is weighed by halves, and the
    planner turns to mixed steps (that run's last 36 s)."""
    compounding = "--mux-prefill-correction compounding"
    under, _ = _slicing_sim(replay_tool, predictor, (0.99, 0.98), 0.5, rule=compounding)
    over, _ = _slicing_sim(replay_tool, predictor, (1.05, 1.04), 0.5, rule=compounding)
    assert under.planner.calibration.prefill_correction("time_slice") == pytest.approx(0.5)
    assert under.log.seconds.get("eager", 0.0) < 0.05 * under.log.seconds["time_slice"]
    assert over.planner.calibration.prefill_correction("time_slice") > 0.9
    assert over.log.seconds["eager"] > over.log.seconds["time_slice"] > 0


def test_the_converging_rule_of_the_server_flags_settles_on_the_pieces(replay_tool,
                                                                        predictor):
    # Pieces at 0.8 of the profile keep the planner slicing while the correction climbs
    # from 0.5; at 0.9 it turned to mixed steps after 12 pieces, the correction at 0.82.
    sim, _ = _slicing_sim(replay_tool, predictor, (1.0, 0.8), 0.5,
                          rule="--mux-prefill-correction converging")
    assert sim.planner.calibration.prefill_rule == "converging"
    assert sim.planner.calibration.prefill_correction("time_slice") == pytest.approx(0.8,
                                                                                    abs=0.02)


def test_the_delivery_rule_learns_from_whole_batches_not_pieces(replay_tool, predictor):
    """Cycles 15% over their profile while each piece runs as predicted, from a correction
    of 0.5: the converging piece rule can rise no further than the pieces' 1.0; the
    delivery rule learns from each completed batch only, a step-limited move per batch."""
    pieces, _ = _slicing_sim(replay_tool, predictor, (1.15, 1.0), 0.5,
                             rule="--mux-prefill-correction converging")
    batches, _ = _slicing_sim(replay_tool, predictor, (1.15, 1.0), 0.5,
                              rule="--mux-prefill-correction delivery")
    assert pieces.planner.calibration.prefill_correction("time_slice") <= 1.0
    learned = batches.planner.calibration
    taught = learned.delivered_batches["time_slice"]
    assert taught > 5 and learned.prefill_pieces == {"time_slice": 1}  # the seeded one
    moved = learned.prefill_correction("time_slice") / 0.5
    assert 1.0 < moved <= (1.25 ** learned.weight) ** taught + 1e-9


def test_the_slice_spread_is_each_piece_over_its_cycle_and_the_cycles_between_them():
    with gzip.open(HELD_OUT_TIMELINE, "rt") as f:
        held_out = json.load(f)
    pairs = slice_spread(held_out)
    pieces = [e for e in held_out if e["mode"] == "time_slice" and e["piece_launched"]]
    assert len(pairs) == len(pieces) == 791
    median = lambda values: sorted(values)[len(values) // 2]
    cycles, own = [c for c, _ in pairs], [p for _, p in pairs]
    assert 0.95 < median(own) < median(cycles) < 1.02  # the host's lag between pieces
    assert sum(c >= p - 1e-9 for c, p in pairs) > 0.95 * len(pairs)


# --------------------------------------------------------------- SM splits

SPLITS = [(16, 116), (24, 108), (32, 100), (48, 84), (64, 68)]
SPATIAL_ARGS = "--schedule multiplex --itl-slo-ms 60 --mux-predictor p --mux-sharing spatial"


def _spatial_sim(replay_tool, predictor, pieces: float = 1.0, decodes: float = 1.0):
    """LooGLE-like prompts of 16K tokens, 3 s apart, beside one long answer, on SM splits
    only; every piece at ``pieces`` and every decode step beside one at ``decodes`` of the
    profile's time."""
    calibration = OnlineCalibration(predictor)
    config = replay_tool.planner_config(SPATIAL_ARGS, time_slice=True, spatial=True)
    planner = MuxPlanner(calibration, SPLITS, config)
    requests = [StepRequest(0.0, 512, 400)] + [StepRequest(1.0 + 3.0 * i, 16000, 64)
                                              for i in range(4)]
    timing = StepTiming(1.0, 1.0, spatial_piece_spread=(pieces,),
                        spatial_decode_spread=(decodes,))
    sim = MuxStepSim(planner, requests, timing, first_token_lag=True)
    sim.run()
    return sim, requests, calibration


def _tpot(request: StepRequest) -> float:
    return (request.finished - request.first_token) / (request.output_len - 1)


def test_the_planner_config_follows_the_sharing_flags_where_other_options_are_modelled(
        replay_tool):
    config = replay_tool.planner_config(SPATIAL_ARGS, time_slice=True, spatial=True)
    assert config.spatial and not config.temporal and not config.time_slice
    assert replay_tool.planner_config(SPATIAL_ARGS).temporal  # the whole-GPU model
    assert not replay_tool.planner_config(SLICING_ARGS, time_slice=True).spatial


def test_pieces_on_a_split_prefill_every_prompt_while_decode_runs_beside_them(
        replay_tool, predictor):
    sim, requests, _ = _spatial_sim(replay_tool, predictor)
    assert sim.modes["spatial"] > 100
    answer, prompts = requests[0], requests[1:]
    for r in requests:
        assert r.prefilled == r.prompt_len and r.decoded + 1 == r.output_len
    # The long answer kept decoding while the prompts prefilled beside it: it ended after
    # the last prompt's first token, each of its tokens within the ITL target.
    assert answer.finished > prompts[-1].first_token and _tpot(answer) < 0.060
    alone = predictor.predict("prefill", 16000, 0, 1, predictor.total_sms) / 1e3
    assert min(r.first_token - r.arrival for r in prompts) > alone  # on a split: slower


def test_slow_pieces_and_slow_decode_on_a_split_teach_their_own_corrections(
        replay_tool, predictor):
    _, profiled, _ = _spatial_sim(replay_tool, predictor)
    _, slow_pieces, learned = _spatial_sim(replay_tool, predictor, pieces=1.5)
    assert min(learned.prefill_corrections.values()) > 1.2
    assert learned.decode_correction == 1.0
    assert slow_pieces[1].first_token - slow_pieces[1].arrival > \
        1.3 * (profiled[1].first_token - profiled[1].arrival)
    _, slow_decode, learned = _spatial_sim(replay_tool, predictor, decodes=1.3)
    assert learned.decode_correction == pytest.approx(1.3, rel=0.02)
    assert _tpot(slow_decode[2]) > 1.1 * _tpot(profiled[2])


def test_engine_timing_takes_every_spread_it_is_given(predictor):
    spread = StepSpread(mixed=(1.05,), decode=(1.2,), slices=((1.1, 1.0),),
                        decode_by_batch=((4, 1.2),), spatial_decode=(1.1,),
                        spatial_pieces=(1.3,))
    timing = engine_timed(predictor, SERVER_ARGS, None, [], spread).timing
    assert (timing.mixed_spread, timing.decode_spread, timing.slice_spread) == (
        (1.05,), (1.2,), ((1.1, 1.0),))
    assert timing.decode_by_batch == ((4, 1.2),)
    assert (timing.spatial_decode_spread, timing.spatial_piece_spread) == ((1.1,), (1.3,))


def test_a_batch_draws_every_step_of_the_batches_nearest_it_not_one_end_of_them():
    # Batch 8 measured 40 times from 1.00 to 1.39, batch 7 ten times at 1.5: a batch
    # past 8, or 8 itself, draws all of batch 8's steps, not its slowest or fastest.
    eight = [(8, 1.0 + 0.01 * i) for i in range(40)]
    pairs = tuple(sorted([(7, 1.5)] * 10 + eight))
    assert sorted(nearest_batch_ratios(pairs, 12, 32)) == [r for _, r in eight]
    assert sorted(nearest_batch_ratios(pairs, 8, 32)) == [r for _, r in eight]
    # too few at the nearest batch: the next nearest joins whole, the smaller one first
    few = ((2, 1.0), (4, 2.0), (4, 2.0), (6, 3.0))
    assert sorted(nearest_batch_ratios(few, 5, 3)) == [2.0, 2.0, 3.0]
    assert sorted(nearest_batch_ratios(few, 3, 2)) == [1.0, 2.0, 2.0]


def test_graph_steps_past_the_largest_measured_batch_run_at_its_mean(replay_tool,
                                                                       predictor):
    """Every decode batch of this replay is past the one measured batch (1): its steps
    spread 0.9-1.3x the profile around a mean of 1.1, and the replay's graph steps land
    there on average, not at the top of the spread."""
    ratios = tuple((1, 0.9 + 0.4 * i / 99) for i in range(100))
    timing = StepTiming(1.0, 1.0, seed=3, graph_mixed_by_batch=ratios,
                        decode_by_batch=tuple((1, 1.0) for _ in range(4)))
    sim, _ = _sim(replay_tool, predictor, timing)
    drawn = [sim._by_batch(ratios, 6) for _ in range(2000)]
    assert sum(drawn) / len(drawn) == pytest.approx(1.1, abs=0.01)


MIXED_AND_SPATIAL_ARGS = SPATIAL_ARGS.replace("--mux-sharing spatial",
                                              "--mux-sharing temporal,spatial")


def _decoding_beside(prompt_tokens: int, pinned: bool, replay_tool, predictor) -> MuxStepSim:
    """A sim with one request decoding and a prompt waiting, a batch on the 48-SM split
    having just ended."""
    config = replay_tool.planner_config(MIXED_AND_SPATIAL_ARGS, time_slice=True, spatial=True)
    planner = MuxPlanner(OnlineCalibration(predictor), SPLITS, config)
    answer, prompt = StepRequest(0.0, 512, 400), StepRequest(0.0, prompt_tokens, 64)
    sim = MuxStepSim(planner, [answer, prompt], pinned_batches=pinned)
    answer.prefilled = answer.prompt_len
    sim.running, sim.waiting = [answer], [prompt]
    sim.pending.clear()
    sim.pinned_split = 48 if pinned else None
    return sim


def test_a_batch_after_one_on_a_split_starts_there_as_the_engine_starts_it(
        replay_tool, predictor):
    """``pinned_batches``: the next batch is planned on the split the last one ended on,
    among that split's option alone (the engine's ``_pinned_planner``), once; without it
    the whole planner weighs every option (``--mux-reweigh-spatial-batches``)."""
    sim = _decoding_beside(16000, True, replay_tool, predictor)
    plan = sim._pinned_plan()
    assert plan is not None and plan.mode == "spatial" and plan.decode_sms == 48
    assert sim.pinned_split is None and sim._pinned_plan() is None  # once only
    assert _decoding_beside(16000, False, replay_tool, predictor)._pinned_plan() is None
    idle = _decoding_beside(16000, True, replay_tool, predictor)
    idle.running = []  # nothing decoding: the lanes drain, the whole planner plans
    assert idle._pinned_plan() is None


def test_a_prefill_alone_after_the_last_decode_does_not_hold_its_token_back(replay_tool,
                                                                            predictor):
    # The engine plans prefill alone only once both lanes drained, so the last decode
    # step's tokens reach the client before it runs (served records: no TPOT past the
    # steps'), not a whole long prefill later.
    short = StepRequest(0.0, 512, 3)
    long = StepRequest(0.001, 16000, 2)
    planner = MuxPlanner(OnlineCalibration(predictor), [],
                         replay_tool.planner_config(SERVER_ARGS))
    sim = MuxStepSim(planner, [short, long], first_token_lag=True)
    sim.run()
    assert sim.log.steps.get("prefill_only", 0) >= 1  # the long prompt's rest ran alone
    assert long.first_token - short.finished > 1.0  # ...after the short one had finished
    assert short.finished - short.first_token < 0.5  # its two tokens came a step apart


def test_the_slo_order_serves_the_prompts_that_can_make_their_deadline_first(replay_tool,
                                                                               predictor):
    # A 16K prompt arrives just ahead of three 2K ones, all with 2.5 s to their first
    # token: in arrival order the 2K prompts wait behind it and miss; in SLO order (the rate
    # learned from the first prompt's launch) they go first and the 16K prompt alone misses.
    def served(order: str) -> list[float]:
        requests = [StepRequest(0.0, 4096, 2), StepRequest(0.01, 16000, 2),
                    *(StepRequest(0.02 + 0.001 * i, 2048, 2) for i in range(3))]
        planner = MuxPlanner(OnlineCalibration(predictor), [],
                             replay_tool.planner_config(SERVER_ARGS))
        sim = MuxStepSim(planner, requests, first_token_lag=True,
                         order=PrefillOrder(order, 2500.0))
        sim.run()
        assert all(r.finished is not None for r in requests)
        return [r.first_token - r.arrival for r in requests]

    fcfs, slo = served("fcfs"), served("slo")
    assert sum(t <= 2.5 for t in fcfs) == 1
    assert sum(t <= 2.5 for t in slo) == 4
    assert max(slo[2:]) < slo[1]  # the 2K prompts before the 16K one
    assert max(fcfs[2:]) > fcfs[1]
