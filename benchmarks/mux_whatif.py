"""What the multiplexing planner predicts it can do, from a fitted profile alone (no GPU).

Walks one long prompt through its prefill beside a constant decode batch, re-planning at
every decode boundary with the real ``MuxPlanner`` and advancing by the plan's *predicted*
times: the prefill rate the planner expects for each set of sharing options
(``--mux-sharing``), ITL target and online correction of mixed steps. It answers "is the
policy or the execution short?": a measured run that trails these figures lost time outside
the planner's model (host gaps, predictions off); a subset that predicts more than the full
set means the planner's choice among them is short-sighted. Every figure is a
prediction (``"kind": "prediction"``), never a measurement.

    python benchmarks/mux_whatif.py \
        --predictor benchmarks/results/loogle_h200/6f90be1_predictor.json \
        --out benchmarks/results/mux_whatif_6f90be1_67fb7e0.json

With ``--timeline`` it reads a measured run's multiplex timeline instead (the
``*_timeline.json[.gz]`` that ``benchmarks/loogle_h200.py`` saves) and reports what each
sharing option really delivered to prefill: prompt tokens per second of wall time over the
batches it ran, against the rate the planner chose them by, and where the timeline records
pieces, each piece's measured time over its predicted one (``"kind": "measurement"``).

    python benchmarks/mux_whatif.py \
        --timeline benchmarks/results/loogle_h200/b249c95_multiplex_rate0.5_timeline.json.gz \
        --out delivered.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from pdserve.bench.timeline import load_engine_timeline as load_timeline  # noqa: E402
from pdserve.bench.timeline import (  # noqa: E402
    mixed_runs,
    piece_times,
    prefill_batches,
    prefill_delivery,
    timeline_beside,
)
from pdserve.config import MUX_SHARING, SchedulerConfig, mux_sharing_options  # noqa: E402
from pdserve.sched.mux_planner import (  # noqa: E402
    DecodeLoad,
    InFlightPrefill,
    MuxMode,
    MuxPlan,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
    option_key,
)
from pdserve.sched.predictor import LatencyPredictor, served_predictor  # noqa: E402
from pdserve.sim.cluster import fit_nonnegative  # noqa: E402
from pdserve.sim.mux_steps import record_server_args  # noqa: E402

SPLITS = ((16, 116), (24, 108), (32, 100), (48, 84), (64, 68))
WAITED_MS = 1e9  # the prompt has waited "forever": the planner may force prefill in


def walk_prompt(planner: MuxPlanner, prompt: int, decode: DecodeLoad,
                piece_timing: dict[str, float] | None = None, *,
                plan_ms: Callable[[MuxPlan], float] | None = None) -> dict:
    """Predicted wall time to prefill ``prompt`` tokens beside ``decode``, the modes used,
    the longest and the mean predicted time between two decode tokens (what the ITL target
    bounds), and the prefill batches it takes (``_starts_batch``). How long a plan takes:
    ``plan_ms`` if given, else ``_plan_ms`` with ``piece_timing``, each option's pieces'
    measured over predicted time (None: by the corrections the planner chose with)."""
    plan_ms = plan_ms or (lambda plan: _plan_ms(plan, piece_timing))
    done, elapsed_ms, in_flight, modes, longest = 0, 0.0, None, {}, 0.0
    running = None  # the option chosen last: a switch away from it pays (rule 4)
    tokens_out, batches, previous = 0.0, 0, None  # decode tokens meanwhile: one per cycle
    while done < prompt or in_flight is not None:
        waiting = [PrefillRequest(prompt - done, done, WAITED_MS)] if done < prompt else []
        plan = planner.plan(decode, waiting, in_flight, running)
        running = plan.option
        modes[str(plan.mode)] = modes.get(str(plan.mode), 0) + 1
        ms = plan_ms(plan)
        elapsed_ms, longest = elapsed_ms + ms, max(longest, plan.cycle_ms)
        tokens_out += ms / plan.cycle_ms if plan.cycle_ms > 0 else 0.0
        batches, previous = batches + _starts_batch(plan, previous), plan.mode
        done, in_flight = _advance(plan, done, in_flight, planner.num_layers)
    return {"prefill_tokens_per_s": 1e3 * prompt / elapsed_ms, "decisions_by_mode": modes,
            "max_cycle_ms": longest, "prefill_batches": batches,
            "mean_cycle_ms": elapsed_ms / tokens_out if tokens_out > 0 else 0.0}


def _starts_batch(plan, previous: MuxMode | None) -> bool:
    """Whether ``plan`` starts a prefill batch as a measured timeline counts them
    (``prefill_batches``, ``mixed_runs``): a batch's first piece, or a run of mixed steps'
    first step."""
    if plan.prefill is None:
        return False
    if plan.mode == MuxMode.TEMPORAL:
        return previous != MuxMode.TEMPORAL
    return bool(plan.prefill.chunks)


def _plan_ms(plan, piece_timing: dict[str, float] | None = None) -> float:
    """Time until the next decision: a spatial piece may outlast its decode step. A piece
    takes its prediction times its option's factor (a time-slice piece: the whole cycle,
    as the engine measures it): ``piece_timing``'s measured one (1.0 for an option it
    lacks), else the prefill correction the planner chose with. The two differ: the
    engine's correction moves by each piece's measured over *uncorrected* predicted time,
    so it drifts to a bound while pieces run a little under or over their prediction (on
    the H200 at 7dad880 time-slice pieces took 0.95 of it, and the correction sat at its
    floor, 0.5: a walk timed by it thought time slices twice as fast as they ran)."""
    if piece_timing is None:
        factor = plan.prefill_calibration
    else:
        factor = piece_timing.get(plan.option, 1.0) if plan.option else 1.0
    if plan.mode == MuxMode.SPATIAL:
        return max(plan.cycle_ms, plan.prefill.predicted_ms * factor)
    return plan.cycle_ms * factor


def _advance(plan, done: int, in_flight: InFlightPrefill | None, num_layers: int):
    piece = plan.prefill
    if piece is None:
        return done, in_flight
    if plan.mode == MuxMode.TEMPORAL:
        return done + piece.num_tokens, None
    if piece.chunks:  # a new batch: its first layers ran
        in_flight = InFlightPrefill(piece.num_tokens, piece.context_tokens, piece.batch_size,
                                    piece.num_layers)
        done += piece.num_tokens
    else:
        layers = in_flight.layers_done + piece.num_layers
        in_flight = InFlightPrefill(in_flight.num_tokens, in_flight.context_tokens,
                                    in_flight.batch_size, layers)
    return done, (None if in_flight.layers_done >= num_layers else in_flight)


def planner_for(predictor, sharing: tuple[str, ...], itl_ms: float, correction: float,
                prefill: dict[str, float] | None = None, max_prefill_tokens: int = 24576,
                decode_correction: float = 1.0, graph_step_tokens: int = 0,
                mixed_floor_tokens: int = 0, graph_correction: float = 1.0) -> MuxPlanner:
    """``prefill``: each option's prefill correction, as serving would have learned it;
    ``decode_correction``: co-running decode steps' and ``graph_correction`` the graph
    mixed steps' (``OnlineCalibration``); ``graph_step_tokens`` and
    ``mixed_floor_tokens``: ``MuxPlannerConfig``'s (0: off)."""
    model = OnlineCalibration(predictor)
    model.mixed_correction = correction
    model.graph_mixed_correction = graph_correction
    model.decode_correction = decode_correction
    model.prefill_corrections.update(prefill or {})
    config = MuxPlannerConfig(itl_slo_ms=itl_ms, max_prefill_tokens=max_prefill_tokens,
                              graph_step_tokens=graph_step_tokens,
                              mixed_floor_tokens=mixed_floor_tokens,
                              **{name: name in sharing for name in MUX_SHARING})
    return MuxPlanner(model, SPLITS, config)


# ------------------------------------------ what a prompt gets beside a decode batch

SHARE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SHARE_CONTEXTS = (512, 2048, 8192, 16384)  # decode context per request
SHARE_PROMPTS = (128, 512, 2048, 8192, 16384)


@dataclass(frozen=True)
class PlannerSettings:
    """What a multiplexing server plans with: its flags (``settings_of``) and what its
    ``OnlineCalibration`` learned (``/v1/engine/info``'s ``calibration``)."""

    itl_ms: float = SchedulerConfig.itl_slo_ms
    sharing: tuple[str, ...] = MUX_SHARING
    max_prefill_tokens: int = SchedulerConfig.max_num_batched_tokens
    mixed_correction: float = 1.0
    decode_correction: float = 1.0
    prefill_corrections: dict[str, float] = field(default_factory=dict)
    # Each option's prefill pieces' measured over predicted time, which the walk advances
    # by (``_plan_ms``); None: by ``prefill_corrections``, the engine's own expectation.
    piece_timing: dict[str, float] | None = None
    graph_step_tokens: int = 0
    mixed_floor_tokens: int = 0
    graph_mixed_correction: float = 1.0

    def planner(self, predictor) -> MuxPlanner:
        return planner_for(predictor, self.sharing, self.itl_ms, self.mixed_correction,
                           self.prefill_corrections, self.max_prefill_tokens,
                           self.decode_correction, self.graph_step_tokens,
                           self.mixed_floor_tokens, self.graph_mixed_correction)

    def learned(self, calibration: dict | None) -> PlannerSettings:
        """These settings with the corrections an engine reported (none: unchanged)."""
        if not calibration:
            return self
        pieces = calibration.get("prefill_pieces", {})
        return replace(self, mixed_correction=calibration["mixed_steps"],
                       graph_mixed_correction=calibration.get("graph_mixed_steps", 1.0),
                       decode_correction=calibration["co_running_decode"],
                       prefill_corrections={k: v["correction"] for k, v in pieces.items()})


def settings_of(command: str, resolved: dict | None = None) -> PlannerSettings:
    """The planner flags of a ``pdserve serve`` command line (the rest ignored). Graph
    steps and the mixed-step floor: the flags where the command names them, else
    ``resolved`` (what the engine planned with: ``/v1/engine/info``'s
    ``graph_step_tokens`` and ``mixed_floor_tokens``), else off, as every run before
    those defaults did."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--itl-slo-ms", type=float, default=SchedulerConfig.itl_slo_ms)
    parser.add_argument("--mux-sharing", default=SchedulerConfig.mux_sharing)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=SchedulerConfig.max_num_batched_tokens)
    parser.add_argument("--mux-graph-step-tokens", type=int)
    parser.add_argument("--mux-mixed-floor-tokens", type=int)
    parser.add_argument("--mux-tpot-bank-cap", type=float, default=0.0)
    parser.add_argument("--mux-ttft-pressed-margin", type=float, default=0.0)
    flags, _ = parser.parse_known_args(shlex.split(command))
    # A command line that left them to the defaults ran what its engine reported (the bank
    # and the pressure are on by default after 8a6ad63).
    flags.mux_tpot_bank_cap = flags.mux_tpot_bank_cap or (resolved or {}).get(
        "tpot_bank_cap", 0.0)
    flags.mux_ttft_pressed_margin = flags.mux_ttft_pressed_margin or (resolved or {}).get(
        "ttft_pressed_margin", 0.0)
    if flags.mux_tpot_bank_cap:
        # The walk plans beside a decode load with no requests behind it: nothing banked.
        raise ValueError(f"--mux-tpot-bank-cap {flags.mux_tpot_bank_cap:g}: the walk does not "
                         "model TPOT slack banked per request")
    if flags.mux_ttft_pressed_margin:
        # One prompt walked at a time, no queue behind it: no TTFT ever pressed.
        raise ValueError(f"--mux-ttft-pressed-margin {flags.mux_ttft_pressed_margin:g}: the "
                         "walk does not model a queue of prompts waiting for their TTFT")
    sharing = tuple(n for n in MUX_SHARING if n in mux_sharing_options(flags.mux_sharing))
    resolved = resolved or {}
    graph = flags.mux_graph_step_tokens
    floor = flags.mux_mixed_floor_tokens
    return PlannerSettings(
        flags.itl_slo_ms, sharing, flags.max_num_batched_tokens,
        graph_step_tokens=resolved.get("graph_step_tokens", 0) if graph is None else graph,
        mixed_floor_tokens=resolved.get("mixed_floor_tokens", 0) if floor is None else floor)


class PlannedShare:
    """What the planner predicts a prompt gets beside a decode batch (``walk_prompt``):
    its prefill time over its time alone on the whole GPU, the time between decode tokens
    meanwhile over the batch's step alone, and the prefill batches it takes; walks kept by
    rounded load."""

    def __init__(self, predictor, settings: PlannerSettings) -> None:
        self.predictor, self.settings = predictor, settings
        self._walks: dict[tuple[int, int, int], tuple[float, float, int]] = {}

    def factors(self, batch: int, context: int, tokens: int) -> tuple[float, float, int]:
        """(prefill, decode, batches) for ``batch`` decodes of ``context`` tokens in all."""
        key = (batch, round(context, -3), max(64, round(tokens / 64) * 64))
        if key not in self._walks:
            self._walks[key] = self._walk(*key)
        return self._walks[key]

    def _walk(self, batch: int, context: int, tokens: int) -> tuple[float, float, int]:
        predictor, sms = self.predictor, self.predictor.total_sms
        walked = walk_prompt(self.settings.planner(predictor), tokens, DecodeLoad(batch, context),
                             self.settings.piece_timing)
        alone_ms = predictor.predict("prefill", tokens, 0, 1, sms)
        step_ms = predictor.predict("decode", batch, context, batch, sms)
        return (1e3 * tokens / walked["prefill_tokens_per_s"] / alone_ms,
                walked["mean_cycle_ms"] / step_ms, walked["prefill_batches"])


def share_table(predictor, settings: PlannerSettings, batches=SHARE_BATCHES,
                contexts=SHARE_CONTEXTS, prompts=SHARE_PROMPTS) -> dict:
    """``PlannerShare``'s tables (not its measured corrections) over a grid of decode
    batches, contexts per request and prompt lengths."""
    planned = PlannedShare(predictor, settings)
    cells = [planned.factors(b, b * c, p) for b in batches for c in contexts for p in prompts]
    return {"batches": tuple(map(float, batches)), "contexts": tuple(map(float, contexts)),
            "prompts": tuple(map(float, prompts)), "prefill": tuple(c[0] for c in cells),
            "decode": tuple(c[1] for c in cells),
            "prefill_batches": tuple(float(c[2]) for c in cells)}


def beside_decode(entries: list[dict], predictor) -> list[dict]:
    """The prefill batches a measured multiplex timeline ran beside a decode batch
    (``prefill_batches``, ``mixed_runs``), each with its prompt tokens, its time, its time
    alone on the whole GPU by the predictor (a run of mixed steps: each step's chunk over
    its prefix), the longest prompt it prefilled part of (``prompt_tokens``: prefix and
    piece) and the decode batch beside it: the median batch of its decisions, and
    that batch's context (which the timeline does not record) from the decode steps the
    planner predicted around its start (``decode_context``)."""
    out = []
    for batch in [b for b in prefill_batches(entries) if b["option"] != "prefill_only"] \
            + mixed_runs(entries):
        end = batch["start"] + batch["seconds"]
        inside = [e for e in entries if batch["start"] <= e["time"] < end and e["decode_batch"]]
        if not inside:
            continue
        size = round(statistics.median(e["decode_batch"] for e in inside))
        near = [decode_context(e, predictor) for e in entries
                if abs(e["time"] - batch["start"]) < 5.0 and e["decode_batch"] == size]
        known = [c for c in near if c is not None]
        if not known:
            continue
        out.append({"option": batch["option"], "tokens": batch["tokens"],
                    "prompt_tokens": max(e["prefill_context_tokens"] + e["prefill_tokens"]
                                         for e in inside),
                    "seconds": batch["seconds"], "alone_s": _alone_s(batch, inside, predictor),
                    "decode_batch": size, "decode_context": statistics.median(known)})
    return out


def _alone_s(batch: dict, inside: list[dict], predictor) -> float:
    if batch["option"] == "temporal":
        pieces = [(e["prefill_tokens"], e["prefill_context_tokens"]) for e in inside
                  if e["mode"] == "temporal" and e.get("prefill_tokens")]
    else:
        pieces = [(batch["tokens"], inside[0]["prefill_context_tokens"])]
    sms = predictor.total_sms
    return sum(predictor.predict("prefill", t, c, 1, sms) for t, c in pieces) / 1e3


def decode_context(entry: dict, predictor) -> float | None:
    """The decode batch's context (tokens in all) that gives the step the planner predicted
    for ``entry`` (linear in it): a spatial split's decode step (over the co-running
    correction the entry carries), a mixed step (over the mixed correction), a time slice's
    or a lone decode step; None for other decisions. A decision that recorded its decode
    launch's context (``decode_context_tokens``, engines since 4cecf99) gives it as is."""
    batch, sms, mode = entry["decode_batch"], entry["decode_sms"], entry["mode"]
    if batch <= 0 or mode not in ("spatial", "time_slice", "decode_only", "temporal"):
        return None
    if entry.get("decode_context_tokens", 0) > 0:
        return float(entry["decode_context_tokens"])
    if mode == "temporal":
        step = lambda c: predictor.predict_mixed(entry["prefill_tokens"],
                                                 entry["prefill_context_tokens"], 1, batch, c)
    else:
        step = lambda c: predictor.predict("decode", batch, c, batch, sms, mode == "spatial")
    corrected = mode in ("spatial", "temporal")
    ms = entry["predicted_decode_ms"] / (entry.get("calibration", 1.0) if corrected else 1.0)
    per_token = (step(100_000) - step(0)) / 100_000
    return max(0.0, (ms - step(0)) / per_token) if per_token > 0 else None


def share_fit(predictor, runs: dict[str, tuple[list[dict], PlannerSettings]],
              train: list[str]) -> dict:
    """The planner's prediction (``PlannedShare``) of each measured batch beside decode,
    its time alone times the planned prefill factor of the prompt it belongs to (a run of
    mixed steps: the longest), against its measured time. Fitted on the ``train`` runs
    (least squares, nothing negative): measured = ``delivered_over_planned`` times planned
    plus ``per_batch_s`` per batch (what a batch costs beyond its pieces: the switch into
    it, the wait for its last piece); beside it the fit of one factor alone (``scalar``).
    Every run's error with each, the other runs held out."""
    rows = {name: _planned(predictor, entries, settings)
            for name, (entries, settings) in runs.items()}
    fitted = [b for name in train for b in rows[name]]
    delivered, per_batch = fit_nonnegative(np.array([[b["planned_s"], 1.0] for b in fitted]),
                                            [b["seconds"] for b in fitted])
    scalar = sum(b["seconds"] for b in fitted) / sum(b["planned_s"] for b in fitted)
    return {"delivered_over_planned": delivered, "per_batch_s": per_batch,
            "runs": {name: _fit_errors(batches, delivered, per_batch, name in train)
                     for name, batches in rows.items()},
            "scalar": {"delivered_over_planned": scalar,
                       "runs": {name: _fit_errors(batches, scalar, 0.0, name in train,
                                                  detail=False)
                                for name, batches in rows.items()}}}


def _planned(predictor, entries: list[dict], settings: PlannerSettings) -> list[dict]:
    """``beside_decode``'s batches, each with the time the planner plans for it."""
    planned = PlannedShare(predictor, settings)
    batches = beside_decode(entries, predictor)
    for b in batches:
        factor = planned.factors(b["decode_batch"], int(b["decode_context"]),
                                 b["prompt_tokens"])[0]
        b["planned_s"] = b["alone_s"] * factor
    return batches


def _over_alone(batches: list[dict], delivered: float, per_batch: float) -> dict:
    """One option's batches: measured and predicted time over their time alone."""
    alone = sum(b["alone_s"] for b in batches)
    predicted = sum(delivered * b["planned_s"] + per_batch for b in batches)
    return {"batches": len(batches),
            "measured_over_alone": round(sum(b["seconds"] for b in batches) / alone, 3),
            "predicted_over_alone": round(predicted / alone, 3)}


def _fit_errors(batches: list[dict], delivered: float, per_batch: float, trained: bool,
                detail: bool = True) -> dict:
    measured = sum(b["seconds"] for b in batches)
    predicted = [delivered * b["planned_s"] + per_batch for b in batches]
    errors = sorted(abs(p / b["seconds"] - 1) for p, b in zip(predicted, batches, strict=True))
    rank = lambda q: errors[min(len(errors) - 1, int(q * len(errors)))]
    row = {"role": "fitted" if trained else "held out", "batches": len(batches),
           "measured_s": round(measured, 2), "predicted_s": round(sum(predicted), 2),
           "error": round(sum(predicted) / measured - 1, 4),
           "per_batch_abs_error_p50": round(rank(0.5), 4),
           "per_batch_abs_error_p90": round(rank(0.9), 4)}
    if not detail:
        return row
    options: dict[str, list[dict]] = {}
    for b in batches:
        options.setdefault(b["option"], []).append(b)
    return {**row, "decode_batches": sorted({b["decode_batch"] for b in batches}),
            "measured_over_alone": round(measured / sum(b["alone_s"] for b in batches), 4),
            "by_option": {option: _over_alone(rows, delivered, per_batch)
                          for option, rows in sorted(options.items())}}


def sharing_sets() -> list[tuple[str, ...]]:
    return [combo for n in (1, 3) for combo in itertools.combinations(MUX_SHARING, n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predictor", help="walk a prompt with this fitted profile")
    parser.add_argument("--timeline", help="instead: what a measured run's options delivered")
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--decode-batches", default="1,2,3")
    parser.add_argument("--decode-context", type=int, default=16000, help="per request")
    parser.add_argument("--itl-ms", default="40,60,80,100")
    parser.add_argument("--corrections", default="1.0,1.1,1.2,1.3,1.5")
    parser.add_argument("--prefill-corrections", default="", type=_options,
                        help="measured over predicted prefill pieces per option, e.g. "
                             "spatial:16=1.2,time_slice=1.1 (default: none)")
    parser.add_argument("--fit-share", metavar="TIMELINES",
                        help="with --predictor: fit what the planner's prompts are delivered "
                        "beside decode on these measured timelines (comma-separated)")
    parser.add_argument("--hold-out", metavar="TIMELINES", default="",
                        help="with --fit-share: timelines checked against the fit, not fitted")
    parser.add_argument("--calibration-from", metavar="RUN.json",
                        help="with --fit-share: the walks plan with this run's learned "
                        "corrections (its engine_info calibration)")
    parser.add_argument("--graph-replay", metavar="TIMELINES",
                        help="with --predictor: re-plan these runs' mixed-step decisions with "
                        "mixed steps on the prefill-step graphs weighed (comma-separated)")
    parser.add_argument("--graph-factors", default="1.0,0.95,0.9,0.85",
                        help="with --graph-replay: graph steps' cost over eager steps' "
                        "(as the run learned them)")
    parser.add_argument("--reweigh-replay", metavar="RECORDS",
                        help="with --predictor: each spatial batch these goodput probes "
                        "started beside decode (their timelines beside them), re-planned by "
                        "the whole planner against the option running before it, as "
                        "--mux-reweigh-spatial-batches weighs it (comma-separated)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if bool(args.predictor) == bool(args.timeline):
        parser.error("give exactly one of --predictor (a prediction) and --timeline")
    if args.timeline:
        return delivered(args.timeline, args.out)
    if args.fit_share:
        return fit_share(args)
    if args.graph_replay:
        return graph_replay(args)
    if args.reweigh_replay:
        return reweigh_replay(args)
    predictor = LatencyPredictor.load(args.predictor)
    rows = []
    for batch, itl, correction, sharing in itertools.product(
            _ints(args.decode_batches), _floats(args.itl_ms), _floats(args.corrections),
            sharing_sets()):
        decode = DecodeLoad(batch, batch * args.decode_context)
        walked = walk_prompt(planner_for(predictor, sharing, itl, correction,
                                         args.prefill_corrections), args.prompt_tokens, decode)
        rows.append({"decode_batch": batch, "itl_ms": itl, "mixed_correction": correction,
                     "sharing": list(sharing), **walked})
    alone_ms = predictor.predict("prefill", args.prompt_tokens, 0, 1, predictor.total_sms)
    result = {"kind": "prediction", "command": " ".join(["python", *sys.argv]),
              "git_revision": os.environ.get("PDSERVE_GIT_REVISION", "unknown"),
              "predictor": args.predictor, "gpu": predictor.gpu_name,
              "model": predictor.model_name, "prompt_tokens": args.prompt_tokens,
              "prefill_corrections": args.prefill_corrections,
              "prefill_alone_tokens_per_s": 1e3 * args.prompt_tokens / alone_ms, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    _print_table(rows)
    return 0


def fit_share(args: argparse.Namespace) -> int:
    """Writes and prints ``share_fit`` over the named timelines (``"kind": "analysis"``).
    Each timeline's run (the JSON beside it) gives the planner's flags; every walk plans
    with the corrections of ``--calibration-from`` (none: 1.0), over the fit the runs planned
    with (``served_predictor``)."""
    predictor = served_predictor(args.predictor)
    learned = None
    if args.calibration_from:
        learned = json.loads(Path(args.calibration_from).read_text())["engine_info"][
            "calibration"]
    train, held = comma_paths(args.fit_share), comma_paths(args.hold_out)
    runs = {path: (load_timeline(path), settings_of(_run_of(path)["server_command"]).learned(
        learned)) for path in train + held}
    result = {"kind": "analysis", "command": " ".join(["python", *sys.argv]),
              "git_revision": os.environ.get("PDSERVE_GIT_REVISION", "unknown"),
              "predictor": args.predictor, "calibration_from": args.calibration_from,
              "corrections": learned, "fitted_on": train, "held_out": held,
              **share_fit(predictor, runs, train)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"measured = {result['delivered_over_planned']:.3f} x planned + "
          f"{result['per_batch_s']:.3f} s per batch (one factor alone: "
          f"{result['scalar']['delivered_over_planned']:.3f})")
    for path, row in result["runs"].items():
        print(f"{Path(path).name:45s} {row['role']:8s} {row['batches']:3d} batches "
              f"measured {row['measured_s']:6.1f} s predicted {row['predicted_s']:6.1f} s "
              f"({row['error']:+.1%}); per batch |error| p50 {row['per_batch_abs_error_p50']:.0%}"
              f" p90 {row['per_batch_abs_error_p90']:.0%}")
    return 0


GRAPH_STEP_TOKENS = 256  # --piecewise-graph-max-tokens at the replayed revisions
LOOGLE_PROMPT = 16000  # the LooGLE-like prompts' middle (12,000-20,000 tokens)


def replay_graph_steps(predictor, entries: list[dict], settings: PlannerSettings,
                       factor: float) -> dict:
    """The decisions beside decode of a measured timeline that start prefill work (each
    mixed step, each spatial or time-slice batch's first piece), re-planned with the run's
    settings and learned corrections, without and with graph steps weighed at ``factor`` of
    the eager steps' learned cost; by the option the run chose. The timeline records a
    batch's prefix, not its prompts' length: one prompt of ``LOOGLE_PROMPT`` tokens is taken
    (or of its prefix and the batch's tokens, if longer)."""
    rows: dict[str, list] = {}
    for entry, incumbent in _starts_beside_decode(entries):
        context = decode_context(entry, predictor)
        if context is None:
            continue
        prefix, tokens = entry["prefill_context_tokens"], entry["prefill_tokens"]
        load = DecodeLoad(entry["decode_batch"], int(context))
        waiting = [PrefillRequest(max(LOOGLE_PROMPT - prefix, tokens), prefix, 0.0)]
        plans = [_replanned(predictor, settings, factor, graph, load, waiting, incumbent)
                 for graph in (0, GRAPH_STEP_TOKENS)]
        rows.setdefault(_option_of(entry), []).append((load, *plans))
    return {"graph_factor": factor,
            "by_option": {option: _replay_summary(r) for option, r in sorted(rows.items())}}


def _starts_beside_decode(entries: list[dict]):
    """(decision, the option running before it) for each mixed step and each spatial or
    time-slice batch's first decision, with a decode batch beside it."""
    starts = {b["start"] for b in prefill_batches(entries)}
    previous = None
    for entry in entries:
        begins = entry["mode"] == "temporal" or (
            entry["mode"] in ("spatial", "time_slice") and entry["time"] in starts)
        if begins and entry["decode_batch"] and entry["prefill_tokens"]:
            yield entry, previous
        previous = _option_of(entry)


def _option_of(entry: dict) -> str | None:
    mode = MuxMode(entry["mode"])
    return option_key(mode, entry["decode_sms"])


def _replanned(predictor, settings: PlannerSettings, factor: float, graph_tokens: int,
               load: DecodeLoad, waiting: list[PrefillRequest], incumbent: str | None):
    planner = settings.planner(predictor)
    model = planner.predictor  # graph steps relative to the run's learned eager steps
    model.graph_mixed_correction = factor * model.mixed_correction
    planner.config = replace(planner.config, graph_step_tokens=graph_tokens)
    return planner.plan(load, waiting, None, incumbent)


def _replay_summary(rows: list) -> dict:
    """How many (load, plan without, plan with graph steps) rows change their choice, how
    many to graph steps, and the mean rate each choice is expected to deliver."""
    chosen = lambda plan: (plan.option, plan.prefill.num_tokens if plan.prefill else 0)
    changed = [(load, on) for load, off, on in rows if chosen(off) != chosen(on)]
    expected = lambda i: round(statistics.mean(r[i].committed_tokens_per_s
                                               / r[i].prefill_calibration for r in rows))
    return {"decisions": len(rows), "changed": len(changed),
            "to_graph_steps": sum(on.mode == MuxMode.TEMPORAL and
                                  on.prefill.num_tokens + load.batch_size <= GRAPH_STEP_TOKENS
                                  for load, on in changed),
            "expected_tokens_per_s_off": expected(1), "expected_tokens_per_s_on": expected(2)}


def graph_replay(args: argparse.Namespace) -> int:
    """Writes and prints ``replay_graph_steps`` per timeline and factor (a prediction).
    The runs' learned corrections are over the fit they planned with (``served_predictor``)."""
    predictor = served_predictor(args.predictor)
    result = {"kind": "prediction", "command": " ".join(["python", *sys.argv]),
              "git_revision": os.environ.get("PDSERVE_GIT_REVISION", "unknown"),
              "predictor": args.predictor, "prompt_tokens_assumed": LOOGLE_PROMPT, "runs": {}}
    for path in comma_paths(args.graph_replay):
        run = _run_of(path)
        settings = settings_of(run["server_command"]).learned(
            run.get("engine_info", {}).get("calibration"))
        result["runs"][path] = [replay_graph_steps(predictor, load_timeline(path), settings, f)
                                for f in _floats(args.graph_factors)]
        for row in result["runs"][path]:
            for option, summary in row["by_option"].items():
                print(f"{Path(path).name:45s} x{row['graph_factor']:<5} {option:11s} {summary}")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


SHAREGPT_PROMPT = 340  # the ShareGPT-like prompts' mean, in tokens


def reweigh_batch_starts(predictor, entries: list[dict], settings: PlannerSettings
                         ) -> list[dict]:
    """Each spatial batch a measured run started beside decode, with the plan the whole
    planner makes for its load against the option running before it (every option weighed,
    a challenger paying for the switch), as ``--mux-reweigh-spatial-batches`` weighs a batch
    about to start beside a split's decode step. The timeline records a batch's tokens, not
    its prompts: prompts of ``SHAREGPT_PROMPT`` tokens without a prefix are taken."""
    rows = []
    for entry, incumbent in _starts_beside_decode(entries):
        context = decode_context(entry, predictor)
        if entry["mode"] != "spatial" or context is None:
            continue
        count = max(1, round(entry["prefill_tokens"] / SHAREGPT_PROMPT))
        waiting = [PrefillRequest(entry["prefill_tokens"] // count, 0, 0.0)] * count
        load = DecodeLoad(entry["decode_batch"], int(context))
        plan = settings.planner(predictor).plan(load, waiting, None, incumbent)
        rows.append({"t": entry.get("t"), "decode_batch": entry["decode_batch"],
                     "batch_tokens": entry["prefill_tokens"], "running_before": incumbent,
                     "ran": _option_of(entry), "ran_planned_tokens_per_s":
                     entry["weighed_tokens_per_s"], "reweighed": plan.option,
                     "reweighed_tokens_per_s": plan.weighed_tokens_per_s,
                     "runner_up": plan.runner_up,
                     "runner_up_tokens_per_s": plan.runner_up_tokens_per_s})
    return rows


def reweigh_replay(args: argparse.Namespace) -> int:
    """Writes and prints ``reweigh_batch_starts`` per goodput probe (a prediction), each
    planned with its server's flags and the corrections it had learned by its end."""
    predictor = served_predictor(args.predictor)
    result = {"kind": "prediction", "command": " ".join(["python", *sys.argv]),
              "git_revision": os.environ.get("PDSERVE_GIT_REVISION", "unknown"),
              "predictor": args.predictor, "prompt_tokens_assumed": SHAREGPT_PROMPT,
              "corrections": "each probe's calibration_after (learned by its end)",
              "runs": {}}
    for path in comma_paths(args.reweigh_replay):
        record = json.loads(Path(path).read_text())
        settings = settings_of(record_server_args(record), record["config"].get("engine")
                               ).learned(record.get("calibration_after"))
        rows = reweigh_batch_starts(predictor, load_timeline(timeline_beside(path)), settings)
        result["runs"][path] = {"batch_starts": rows, "another_option_wins": sum(
            not r["reweighed"].startswith("spatial") for r in rows)}
        for r in rows:
            print(f"{Path(path).stem[:50]:50s} t={r['t'] or 0:6.2f} {r['decode_batch']:4d} "
                  f"decodes {r['batch_tokens']:6d} tokens ran {r['ran']} "
                  f"({r['ran_planned_tokens_per_s']:.0f}/s); reweighed: {r['reweighed']} "
                  f"({r['reweighed_tokens_per_s']:.0f}/s) over {r['runner_up']} "
                  f"({r['runner_up_tokens_per_s']:.0f}/s)")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def comma_paths(text: str) -> list[str]:
    """The paths of a comma-separated flag value."""
    return [p for p in text.split(",") if p]


def _run_of(timeline: str) -> dict:
    """The run a ``*_timeline.json[.gz]`` belongs to: the JSON beside it."""
    name = Path(timeline).name.split("_timeline.json")[0]
    return json.loads((Path(timeline).parent / f"{name}.json").read_text())


def delivered(timeline: str, out: str) -> int:
    """Writes and prints what each option of a measured run delivered to prefill."""
    entries = load_timeline(timeline)
    result = {"kind": "measurement", "command": " ".join(["python", *sys.argv]),
              "timeline": timeline, "prefill_delivery": prefill_delivery(entries),
              "piece_times": piece_times(entries)}
    Path(out).write_text(json.dumps(result, indent=1))
    for option, row in result["prefill_delivery"].items():
        print(f"{option:14s} {row['batches']:3d} batches {row['seconds']:7.1f} s "
              f"{row['realized_tokens_per_s']:6d} tok/s realized, "
              f"{row['committed_tokens_per_s']:6d} chosen by ({row['realized_over_committed']}), "
              f"{row['switches']} option switches inside batches")
    for option, row in result["piece_times"].items():
        print(f"{option:14s} pieces {row}")
    return 0


def _print_table(rows: list[dict]) -> None:
    for row in rows:
        print(f"b{row['decode_batch']} itl {row['itl_ms']:.0f} c {row['mixed_correction']:.1f} "
              f"{'+'.join(row['sharing']):30s} {row['prefill_tokens_per_s']:7.0f} tok/s "
              f"cycle <= {row['max_cycle_ms']:5.1f} ms {row['decisions_by_mode']}")


def _options(text: str) -> dict[str, float]:
    """``option=factor,...`` (an empty string: none)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected option=factor pairs, got {text!r}")
    return {option: float(factor) for option, factor in pairs}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
