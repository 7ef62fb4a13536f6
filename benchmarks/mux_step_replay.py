"""Multiplexing's whole-GPU steps replayed on a recorded probe's requests, step by step, with
the real ``MuxPlanner`` choosing every step and the fitted profile timing it (no GPU).

Where the planner walk (``mux_whatif.py``) follows one prompt beside a constant decode
batch, this replay keeps the queue: requests arrive at a goodput probe's send times with
its prompt and output lengths, wait first come first served (``waited_ms`` as the engine
reports it), and decode from the step after their last prompt piece. Each step is the
planner's plan over the whole GPU: a mixed step (TEMPORAL), decode alone, or a prefill
alone; the step takes the profile's predicted time. It models the options that keep the
GPU whole (``--mux-sharing temporal``), so it fits a workload whose busy stretch ran mixed
steps (the ShareGPT-like probes at 12-16 req/s); with ``--spread-from`` (another run of the
probe: its engine timing) time slices and SM splits are replayed too, as the server's
flags allow, each batch after one on a split starting there as the engine starts it unless
the flags name ``--mux-reweigh-spatial-batches`` (``pinned_batch_starts`` in each row;
replays before this rule re-planned every batch with the whole planner). What it is
for: the planner settings' effect at one load, compared with the settings a measured
probe ran (the replay of those settings is the check). Every figure
is a prediction (``"kind": "prediction"``).

With ``--validation`` it replays instead the multiplex run of an H200 simulator validation
(``sim_validate_instance.py``: the Mooncake window it sent, whose busy stretch ran whole-GPU
steps from 8ccd9ac on) and sets each replay's P50 / P99 of TTFT and TPOT beside the
measured ones, as ``"kind": "validation"``:

- ``compare``: the planner starting from the mixed-step corrections the engine had
  learned on the probes before that replay (``engine_calibration``), each step at its
  corrected prediction, the corrections fixed; the engine's end state
  (``engine_calibration_after_replay``) beside it, for the spread, never as the model.
- ``engine_timed``: the step model of ``pdserve/sim/mux_steps.py`` with engine timing:
  each mixed-step path (graph, eager) at the correction the engine learned for it on the
  probes, a measured over predicted ratio drawn per step from another run's replay
  timeline (``--spread-from``, ``--seeds`` draws), the corrections learning from every
  step as the engine's do, the first token a step late; time slices where the run's
  server flags allow them, each cycle at a (cycle, piece) pair drawn from another run's
  time-slice pieces (``--slice-spread-from``), the time-slice correction learning from
  each piece by the server's rule. Nothing in it is fitted on the replay it is checked
  against.
- ``diagnosis`` (where the run committed a replay timeline of whole-GPU steps only): not a
  prediction. The same steps planned with the corrections the engine held at each moment
  of that replay, then also with its stalls (steps over 3x their prediction) added: what
  is left beside the measured is the step model's error; the rest is the corrections'
  course. The timeline's steps per kind beside the model's (``measured_steps_by_kind``).

    cd benchmarks/results/goodput_h200 && python ../../mux_step_replay.py \\
        --record sharegpt__multiplex-graph-floor-bank3-itl60__r16.json --rates 16,18 \\
        --variant "--mux-ttft-pressed-margin 1 --ttft-slo-ms 2000" --out replay.json
    R=benchmarks/results/sim_validate_instance_h200
    python benchmarks/mux_step_replay.py --validation ${R}_8ccd9ac.json --out v.json \\
        --spread-from ${R}_7dad880_multiplex_timeline_replay.json.gz --seeds 20
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_goodput_probes import attainment, load_probe, measured_rows  # noqa: E402
from benchmarks.sim_validate_instance import latency_rows  # noqa: E402
from benchmarks.validate_sim import percentiles  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.bench.timeline import load_engine_timeline as load_timeline  # noqa: E402
from pdserve.bench.timeline import timeline_beside  # noqa: E402
from pdserve.sched.mux_planner import MuxMode, MuxPlanner, OnlineCalibration  # noqa: E402
from pdserve.sched.predictor import LatencyPredictor, served_predictor  # noqa: E402
from pdserve.sched.prefill_order import PrefillOrder  # noqa: E402
from pdserve.sim.mux_steps import (  # noqa: E402
    MODELLED_MODES,
    StepSpread,
    StepTiming,
    calibrated,
    correction_trajectory,
    median_log,
    path_factors,
    planner_config,
    record_server_args,
    scheduler_config,
    slice_spread,
    step_spread,
    timeline_accuracy,
    timeline_stalls,
    timeline_steps_by_kind,
    whole_gpu_only,
)
from pdserve.sim.mux_steps import MuxStepSim as StepReplay  # noqa: E402
from pdserve.sim.mux_steps import StepRequest as Replayed  # noqa: E402
from pdserve.sim.mux_steps import engine_timed as engine_timed_sim  # noqa: E402


def replay(record: dict, predictor: LatencyPredictor, variant: str = "",
           rate: float | None = None, eager: EagerSteps | None = None,
           twin: Twin | None = None, seed: int = 0) -> dict:
    """The record's requests replayed with ``variant``'s planner flags; at ``rate`` (req/s)
    their send times are rescaled from the probe's rate to it. With ``eager``, eager mixed
    steps take that factor of the profile's time and the planner starts from that
    correction, learning from the steps as the engine does (else every step takes its
    prediction and nothing is learned). With ``twin``, every step as the engine timed
    another run's (``Twin``), seed ``seed``, time slices and SM splits (the record's) as
    the server's flags allow; the corrections start at the profile and learn."""
    server_args = record_server_args(record)
    config = planner_config(server_args, variant, time_slice=twin is not None,
                            spatial=twin is not None)
    splits = [tuple(split) for split in record.get("partitions", {}).get("splits", [])]
    timing = None
    if twin is not None:
        calibration = calibrated(predictor, None, f"{server_args} {variant}")
        timing = twin.timing(seed)
    elif eager is None:
        calibration = OnlineCalibration(predictor)
    else:
        calibration = calibrated(predictor, {"mixed_steps": eager.start_correction},
                                 f"{server_args} {variant}")
        timing = StepTiming(1.0, eager.factor)
    planner = MuxPlanner(calibration, splits if config.spatial else [], config)
    probed = record["probe"]["rate"]
    scale = probed / rate if rate else 1.0
    requests = [Replayed(s["send_s"] * scale, s["prompt_len"], s["output_tokens"])
                for s in record["samples"]]
    # The client sees a step's tokens a step late (overlap scheduling), as the validation
    # replays model it: without it the floor512 ShareGPT-like probes' first 40 requests
    # came 22 ms (a decode step, median) under their measured TTFT.
    # SM splits replayed: a batch starts on the split the last one ended on as the engine
    # starts it, unless the flags reweigh it (--mux-reweigh-spatial-batches).
    sched = scheduler_config(server_args, variant)
    pinned = config.spatial and not sched.mux_reweigh_spatial_batches
    order = PrefillOrder(sched.prefill_order, sched.ttft_slo_ms,  # FCFS unless slo
                         sched.prefill_order_max_wait_ms)
    run = StepReplay(planner, requests, timing, first_token_lag=True, pinned_batches=pinned,
                     order=order)
    run.run()
    rows = latency_rows(requests)
    slo = record["summary"]["slo"]
    by_window = ({"ttft_by_send_window": ttft_by_window(record, rows)}
                 if scale == 1.0 else {})
    return {"rate": rate or probed, "variant": variant, "steps": run.modes,
            **by_window,
            "pinned_batch_starts": pinned, "prefill_order": sched.prefill_order,
            "mixed_step_ms": step_percentiles(run.log.durations.get("graph", [])
                                              + run.log.durations.get("eager", [])),
            **({"seed": seed} if twin else {}),
            **({"eager": dataclasses.asdict(eager),
                "eager_correction_after": round(calibration.mixed_correction, 4)}
               if eager else {}),
            "busy_s": run.busy_s,
            "attainment": attainment(rows, slo["ttft_ms"] / 1e3, slo["itl_ms"] / 1e3),
            "ttft_s": percentiles(rows, "ttft_s"), "tpot_s": percentiles(rows, "tpot_s")}


@dataclasses.dataclass(frozen=True)
class Twin:
    """Engine timing taken from another run of a probe (its record and timeline): mixed
    steps at the path factors it learned (``calibration_after``) times its steps' measured
    over predicted spread, decode alone at its steps' measured over profile time drawn by
    batch. The replay of a run with its twin's timing is a prediction of that run."""

    record: str
    graph_factor: float
    eager_factor: float
    spread: StepSpread

    @classmethod
    def load(cls, record_path: Path, predictor: LatencyPredictor | None = None) -> Twin:
        """With ``predictor`` (the one the twin's engine planned with), its mixed steps
        on the prefill-step graphs timed by their decode batch (``graph_mixed_by_batch``)."""
        record = load_probe(record_path)
        timeline = load_timeline(timeline_beside(record_path))
        graph, eager = path_factors(record.get("calibration_after"))
        # a twin without its server flags has no graph size to tell its graph steps by
        graph_tokens = (planner_config(record_server_args(record)).graph_step_tokens or 0
                        if predictor is not None and "config" in record else 0)
        spread = step_spread(timeline, _relative(record_path), predictor, graph_tokens)
        slices = slice_spread(timeline)
        if slices:
            spread = dataclasses.replace(spread, slices=slices,
                                         slice_source=_relative(record_path))
        return cls(_relative(record_path), graph, eager, spread)

    def timing(self, seed: int) -> StepTiming:
        return self.spread.timing(self.graph_factor, self.eager_factor, seed)


@dataclasses.dataclass(frozen=True)
class EagerSteps:
    """Eager mixed steps taking ``factor`` times the profile's time, the planner starting
    from ``start_correction`` (a correction a fresh server learned in its first seconds)."""

    factor: float = 1.0
    start_correction: float = 1.0


def replay_validation(run: dict, predictor: LatencyPredictor,
                      spread: StepSpread | None = None, seeds: int = 1,
                      timeline: list[dict] | None = None) -> dict:
    """A validation run's multiplex replay through whole-GPU steps against its measured
    requests: as planned from each of the engine's recorded calibrations (the corrections
    fixed), then as the engine times and learns (``engine_timed``) and, where the run kept
    its replay's ``timeline`` of whole-GPU steps only, what that timeline says
    (``diagnosis``)."""
    from benchmarks.validate_sim import compare_percentiles

    schedule = run["schedules"]["multiplex"]
    server_args, window = _validation_setup(run)
    calibrations = {name: schedule["interference"][name] for name in CALIBRATIONS
                    if schedule["interference"].get(name)}
    replayed, steps = {}, {}
    for name, corrections in calibrations.items():
        sim = _replayed(server_args, window, calibrated(predictor, corrections, server_args),
                        time_slice=True)
        replayed[name], steps[name] = latency_rows(sim.requests), sim.modes
    result = {"kind": "validation", "num_instances": 1, "server_args": server_args,
              "requests": len(window), "steps": steps}
    if "measured_per_request" in schedule:
        measured_rows = schedule["measured_per_request"]
        figures = {key: percentiles(measured_rows, key) for key in ("ttft_s", "tpot_s")}
        result["compare"] = compare_percentiles(figures, replayed)
    result["engine_timed"] = engine_timed(run, predictor, spread, seeds)
    if timeline is not None and whole_gpu_only(timeline):
        result["diagnosis"] = diagnosis(run, predictor, timeline)
    return result


CALIBRATIONS = ("engine_calibration", "engine_calibration_after_replay")


def _validation_setup(run: dict) -> tuple[str, list]:
    """The planner flags the run's multiplex engine served with (``engine_planner_args``)
    and the window of requests it was sent."""
    from benchmarks.sim_validate_instance import engine_planner_args, window_requests
    from pdserve.sim.cluster import LatencyModel

    schedule = run["schedules"]["multiplex"]
    server_args = engine_planner_args(schedule["schedule_args"], schedule["interference"])
    window, _ = window_requests(argparse.Namespace(**run["config"]),
                                LatencyModel(**schedule["latency_model"]))
    return server_args, window


def _replayed(server_args: str, window: list, calibration: OnlineCalibration,
              timing: StepTiming | None = None, lag: bool = False,
              sim_class: type[StepReplay] = StepReplay, time_slice: bool = False
              ) -> StepReplay:
    requests = [Replayed(r.arrival, r.input_len, r.output_len) for r in window]
    planner = MuxPlanner(calibration, [], planner_config(server_args, time_slice=time_slice))
    sim = sim_class(planner, requests, timing, first_token_lag=lag)
    sim.run()
    return sim


def engine_timed(run: dict, predictor: LatencyPredictor, spread: StepSpread | None,
                 seeds: int) -> dict:
    """The replay on the step model as the engine times it (``mux_steps.engine_timed``:
    each mixed-step path at the correction the engine learned for it on the probes, a
    ratio of ``spread`` drawn per step, the corrections learning as the engine's do, the
    first token a step late); ``seeds`` draws, their percentiles' median beside the
    smallest and largest (``percentiles``' draws)."""
    from benchmarks.validate_sim import compare_percentiles

    schedule = run["schedules"]["multiplex"]
    corrections = schedule["interference"].get("engine_calibration")
    server_args, window = _validation_setup(run)
    rows, logs, slice_corrections = [], [], []
    for seed in range(seeds):
        requests = [Replayed(r.arrival, r.input_len, r.output_len) for r in window]
        sim = engine_timed_sim(predictor, server_args, corrections, requests, spread, seed,
                               time_slice=True)
        rows += [{**row, "draw": seed} for row in latency_rows(requests)]
        logs.append(sim.log)
        slice_corrections.append(sim.planner.calibration.prefill_correction("time_slice"))
    measured = {key: schedule["compare"][key]["measured"] for key in ("ttft_s", "tpot_s")}
    compare = compare_percentiles(measured, {"simulated": rows})
    graph, eager = path_factors(corrections)
    start = ((corrections or {}).get("prefill_pieces") or {}).get("time_slice", {})
    return {"path_factors": {"graph": graph, "eager": eager},
            "spread_from": spread.source if spread else None,
            "slice_spread_from": spread.slice_source if spread else None,
            "slice_spread_pieces": len(spread.slices) if spread else 0,
            "prefill_rule": scheduler_config(server_args).mux_prefill_correction,
            "time_slice_correction": {
                "start": start.get("correction", 1.0),
                "end_median": sorted(slice_corrections)[len(slice_corrections) // 2],
                "end_range": [min(slice_corrections), max(slice_corrections)]},
            "seeds": seeds,
            "compare": compare, "draw_range": _draw_range(rows),
            "within_10_percent": _within(compare, "simulated_error"),
            "steps_by_kind": median_log(logs),
            "engine_options": _engine_options(schedule)}


def _draw_range(rows: list[dict]) -> dict:
    """Per metric and percentile, the smallest and largest over the draws."""
    draws = sorted({row["draw"] for row in rows})
    each = [percentiles([r for r in rows if r["draw"] == d], key) | {"key": key}
            for d in draws for key in ("ttft_s", "tpot_s")]
    return {key: {q: [min(e[q] for e in each if e["key"] == key),
                      max(e[q] for e in each if e["key"] == key)] for q in ("p50", "p99")}
            for key in ("ttft_s", "tpot_s")}


def _within(compare: dict, name: str, tolerance: float = 0.10) -> dict:
    return {key: {q: abs(row[name][q]) <= tolerance for q in ("p50", "p99")}
            for key, row in compare.items()}


def _engine_options(schedule: dict) -> dict:
    """Seconds per mode the engine ran in the replay (its ``timeline_replay``), and whether
    the step model runs them all: it has no spatial splits."""
    seconds = schedule["interference"].get("timeline_replay", {}).get("seconds_by_mode")
    if seconds is None:
        return {"seconds_by_mode": None, "modelled": None}
    modelled = all(mode in MODELLED_MODES for mode, s in seconds.items() if s > 0)
    return {"seconds_by_mode": seconds, "modelled": modelled}


def diagnosis(run: dict, predictor: LatencyPredictor, timeline: list[dict]) -> dict:
    """Not a prediction: the replay planned with the corrections the engine held at each
    moment of its own replay (``correction_trajectory``), each step at its corrected
    prediction, the first token a step late; then also with the steps that ran over
    ``STALL_OVER`` times their prediction taking that long (``stalls``). What is left
    beside the measured is the step model's; the rest is the corrections' course."""
    from benchmarks.validate_sim import compare_percentiles

    schedule = run["schedules"]["multiplex"]
    server_args, window = _validation_setup(run)
    start = schedule["interference"].get("engine_calibration")
    planner = schedule["interference"].get("engine_planner") or {}
    graph, eager = path_factors(start)
    trajectory = correction_trajectory(timeline, (eager, graph),
                                       planner.get("graph_step_tokens", 0))
    stalls = timeline_stalls(timeline, STALL_OVER)
    replayed = {}
    for name, extra in (("trajectory", []), ("trajectory_and_stalls", stalls)):
        sim_class = _trajectory_sim(trajectory, extra)
        sim = _replayed(server_args, window, calibrated(predictor, start), lag=True,
                        sim_class=sim_class)
        replayed[name] = latency_rows(sim.requests)
    measured = {key: schedule["compare"][key]["measured"] for key in ("ttft_s", "tpot_s")}
    return {"stalls": [{"at_s": at, "extra_s": extra} for at, extra in stalls],
            "measured_steps_by_kind": timeline_steps_by_kind(
                timeline, planner.get("graph_step_tokens", 0)),
            "measured_over_predicted_by_kind": timeline_accuracy(
                timeline, trajectory, planner.get("graph_step_tokens", 0)),
            "compare": compare_percentiles(measured, replayed)}


STALL_OVER = 3.0  # a step over 3x its prediction: a stall, not the step's shape


def _trajectory_sim(trajectory: list[tuple[float, float, float]],
                    stalls: list[tuple[float, float]]) -> type[StepReplay]:
    times = [t for t, _, _ in trajectory]

    class TrajectoryReplay(StepReplay):
        """Plans each step with the engine's corrections of that moment; a stall's extra
        time is added to the first step at or after it."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.pending_stalls = list(stalls)

        def _step(self) -> None:
            index = max(0, bisect.bisect_right(times, self.now) - 1)
            _, mixed, graph = trajectory[index]
            self.planner.calibration.mixed_correction = mixed
            self.planner.calibration.graph_mixed_correction = graph
            while self.pending_stalls and self.pending_stalls[0][0] <= self.now:
                self.now += self.pending_stalls.pop(0)[1]
            super()._step()

    return TrajectoryReplay


def measured(record: dict, record_path: Path | None = None) -> dict:
    """The probe's figures; with its timeline beside ``record_path``, its mixed steps' wall
    times too (``measured_cycle_ms``), what the replay's steps are set beside."""
    rows = measured_rows(record)
    result = {"attainment": record["summary"]["slo_attainment"],
              "ttft_s": percentiles(rows, "ttft_s"), "tpot_s": percentiles(rows, "tpot_s")}
    timeline = record_path and timeline_beside(record_path)
    if timeline and timeline.exists():
        result["mixed_step_ms"] = step_percentiles(
            [e["measured_cycle_ms"] / 1e3 for e in load_timeline(timeline)
             if e["mode"] == MuxMode.TEMPORAL])
    return result


TTFT_WINDOW_S = 2.0


def ttft_by_window(record: dict, rows: list[dict]) -> dict:
    """Measured and replayed TTFT medians (s) of the requests sent in each
    ``TTFT_WINDOW_S`` window of the probe (the replay at the probe's own rate, request by
    request): where the replay keeps up with the measured queue and where it drains
    faster. Windows start at ``window_start_s``; a window nobody was sent in is left out."""
    sent = np.array([s["send_s"] for s in record["samples"]])
    measured_s = np.array([s["ttft_ms"] / 1e3 for s in record["samples"]])
    replayed_s = np.array([r["ttft_s"] for r in rows])
    windows = np.floor(sent / TTFT_WINDOW_S).astype(int)
    result: dict[str, list] = {"window_start_s": [], "requests": [], "measured_p50_s": [],
                               "replayed_p50_s": []}
    for window in sorted(set(windows.tolist())):
        inside = windows == window
        result["window_start_s"].append(window * TTFT_WINDOW_S)
        result["requests"].append(int(inside.sum()))
        result["measured_p50_s"].append(round(float(np.median(measured_s[inside])), 4))
        result["replayed_p50_s"].append(round(float(np.median(replayed_s[inside])), 4))
    return result


def step_percentiles(seconds: list[float]) -> dict:
    """Steps' count and P10 / P50 / P90 / P99 in ms: a mixed step's time is the TPOT of
    every request decoding in it."""
    if not seconds:
        return {"steps": 0}
    ms = np.array(seconds) * 1e3
    return {"steps": len(seconds), **{f"p{q}": round(float(np.percentile(ms, q)), 2)
                                      for q in (10, 50, 90, 99)}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--record", type=Path,
                        help="A probe of multiplexing: goodput_h200.py's JSON, or a "
                             "loogle_h200.py row with its _records.json beside it.")
    source.add_argument("--validation", type=Path,
                        help="A simulator validation (sim_validate_instance.py's JSON) "
                             "whose multiplex replay to replay.")
    parser.add_argument("--predictor", type=Path, default=None,
                        help="Fitted profile (default: the one the record names).")
    parser.add_argument("--fit", choices=("saved", "today"), default="saved",
                        help="With --record: the profile's fit as saved in its file, which "
                        "the probe's server planned with (default), or as today's engine "
                        "makes it from that file (an older format refit from its rows, "
                        "e.g. with the GEMM tile steps): what a rerun of the probe plans "
                        "with.")
    parser.add_argument("--variant", action="append", default=[],
                        help="Planner flags over the record's server flags; repeatable. "
                             "The record's own settings are always replayed first.")
    parser.add_argument("--rates", default="",
                        help="Comma-separated req/s to replay the record's arrivals at, "
                             "rescaled (default: the probe's own rate).")
    parser.add_argument("--spread-from", type=Path, default=None,
                        help="With --validation: a multiplex replay timeline "
                             "(*_multiplex_timeline_replay.json.gz) of another run whose "
                             "steps' measured over predicted times the engine-timed replay "
                             "draws (default: none, each step as its path's factor says). "
                             "With --record: another run's goodput record (its timeline "
                             "beside it) whose engine timing every step takes (Twin).")
    parser.add_argument("--slice-spread-from", type=Path, default=None,
                        help="With --validation: a multiplex timeline of another run whose "
                             "time-slice pieces' measured over predicted cycles the "
                             "engine-timed replay draws (default: none, each cycle as "
                             "profiled).")
    parser.add_argument("--eager-factor", type=float, default=None,
                        help="With --record: eager mixed steps take this factor of the "
                        "profile's time, the corrections learning (default: every step as "
                        "predicted, nothing learned).")
    parser.add_argument("--start-eager-correction", type=float, default=1.0,
                        help="With --eager-factor: the eager correction the planner starts "
                        "from.")
    parser.add_argument("--graph-steps-by-batch", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="with --spread-from: time each mixed step on the prefill-step "
                        "graphs by the other run's such steps at the nearest decode batches "
                        "(measured over the profile), not by its one learned factor "
                        "(with --validation: the graph size its engine planned with)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="With --spread-from: draws of that spread (default 1).")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.validation and args.fit != "saved":
        parser.error("--fit applies to --record: a validation replays the fit its engine "
                     "planned with")
    if args.validation:
        return validate(args)
    record = load_probe(args.record)
    predictor_path = args.predictor or ROOT / record["predictor"]["path"]
    # The probe as served: its server planned with the fit saved in the file, and a spread
    # drawn from another run is measured over the fit that run saved. ``today``: as a
    # rerun's server would plan, the spread then measured over a fit the run did not have.
    predictor = (served_predictor(predictor_path) if args.fit == "saved"
                 else LatencyPredictor.load(predictor_path))
    rates = [float(r) for r in args.rates.split(",") if r] or [None]
    eager = None if args.eager_factor is None else EagerSteps(args.eager_factor,
                                                               args.start_eager_correction)
    twin = (Twin.load(args.spread_from, predictor if args.graph_steps_by_batch else None)
            if args.spread_from else None)
    if twin and eager:
        raise SystemExit("--spread-from and --eager-factor: one timing at a time")
    seeds = range(args.seeds) if twin else [0]
    result = {**result_header({"record": _relative(args.record),
                               "predictor": _relative(predictor_path),
                               "predictor_fit": args.fit,
                               "variants": args.variant, "rates": args.rates,
                               "eager_factor": args.eager_factor,
                               "start_eager_correction": args.start_eager_correction,
                               "spread_from": twin.record if twin else None,
                               "graph_steps_by_batch": bool(
                                   twin and twin.spread.graph_mixed_by_batch),
                               "seeds": len(seeds)}),
              "kind": "prediction", "record_revision": record["git_revision"],
              "measured": measured(record, args.record),
              "replayed": [replay(record, predictor, v, rate, eager, twin, seed)
                           for rate in rates for v in ["", *args.variant] for seed in seeds]}
    write_json(result, args.out)
    for row in result["replayed"]:
        seed = f", seed {row['seed']}" if "seed" in row else ""
        print(f"{row['rate']:g} req/s, {row['variant'] or '(as run)'}{seed}: "
              f"attainment {row['attainment']:.2f}, "
              f"TTFT p50/p99 {row['ttft_s']['p50']:.2f}/{row['ttft_s']['p99']:.2f} s, "
              f"TPOT p50/p99 {1e3 * row['tpot_s']['p50']:.0f}/"
              f"{1e3 * row['tpot_s']['p99']:.0f} ms")


def validate(args) -> None:
    run = json.loads(args.validation.read_text())
    predictor_path = args.predictor or ROOT / _predictor_of(run["schedules"]["multiplex"])
    predictor = served_predictor(predictor_path)
    spread = (_validation_spread(run, args.spread_from, predictor, args.graph_steps_by_batch)
              if args.spread_from else StepSpread())
    if args.slice_spread_from:
        spread = dataclasses.replace(
            spread, slices=slice_spread(load_timeline(args.slice_spread_from)),
            slice_source=_relative(args.slice_spread_from))
    timeline_path = _timeline_of(args.validation)
    timeline = load_timeline(timeline_path) if timeline_path.exists() else None
    result = {**result_header({"validation": _relative(args.validation),
                               "predictor": _relative(predictor_path),
                               "spread_from": args.spread_from and _relative(args.spread_from),
                               "slice_spread_from": args.slice_spread_from
                               and _relative(args.slice_spread_from),
                               "graph_steps_by_batch": bool(spread.graph_mixed_by_batch),
                               "seeds": args.seeds}),
              "validation_revision": run["git_revision"],
              "timeline": _relative(timeline_path) if timeline else None,
              **replay_validation(run, predictor, spread, args.seeds, timeline)}
    write_json(result, args.out)
    for key, row in result.get("compare", {}).items():
        print(f"{key} P50 / P99: {_errors(row)}")
    for key, row in result["engine_timed"]["compare"].items():
        print(f"engine-timed {key} P50 / P99: {_errors(row)}")
    for key, row in result.get("diagnosis", {}).get("compare", {}).items():
        print(f"diagnosis {key} P50 / P99: {_errors(row)}")


def _validation_spread(run: dict, path: Path, predictor: LatencyPredictor,
                       by_batch: bool) -> StepSpread:
    """The steps of the timeline at ``path`` as the validation's engine timing; with
    ``by_batch`` its mixed steps on the prefill-step graphs (at the graph size the
    validation's engine planned with) by decode batch over the profile's time, as a
    record's twin draws them."""
    planner = run["schedules"]["multiplex"]["interference"].get("engine_planner") or {}
    graph_tokens = (planner.get("graph_step_tokens") or 0) if by_batch else 0
    return step_spread(load_timeline(path), _relative(path), predictor, graph_tokens)


def _errors(row: dict) -> str:
    return ", ".join(f"{name[:-6]} {100 * e['p50']:+.1f}% / {100 * e['p99']:+.1f}%"
                     for name, e in row.items() if name.endswith("_error"))


def _timeline_of(validation: Path) -> Path:
    """Where ``sim_validate_instance.py`` commits a run's replay timeline, beside it."""
    return validation.with_name(validation.stem + "_multiplex_timeline_replay.json.gz")


def _predictor_of(schedule: dict) -> str:
    return shlex.split(schedule["schedule_args"])[
        shlex.split(schedule["schedule_args"]).index("--mux-predictor") + 1]


def _relative(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    main()
