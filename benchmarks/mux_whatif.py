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
import gzip
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from pdserve.bench.timeline import piece_times, prefill_delivery  # noqa: E402
from pdserve.config import MUX_SHARING  # noqa: E402
from pdserve.sched.mux_planner import (  # noqa: E402
    DecodeLoad,
    InFlightPrefill,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)
from pdserve.sched.predictor import LatencyPredictor  # noqa: E402

SPLITS = ((16, 116), (24, 108), (32, 100), (48, 84), (64, 68))
WAITED_MS = 1e9  # the prompt has waited "forever": the planner may force prefill in


def walk_prompt(planner: MuxPlanner, prompt: int, decode: DecodeLoad) -> dict:
    """Predicted wall time to prefill ``prompt`` tokens beside ``decode``, the modes used and
    the longest predicted time between two decode tokens (what the ITL target bounds)."""
    done, elapsed_ms, in_flight, modes, longest = 0, 0.0, None, {}, 0.0
    running = None  # the option chosen last: a switch away from it pays (rule 4)
    while done < prompt or in_flight is not None:
        waiting = [PrefillRequest(prompt - done, done, WAITED_MS)] if done < prompt else []
        plan = planner.plan(decode, waiting, in_flight, running)
        running = plan.option
        modes[str(plan.mode)] = modes.get(str(plan.mode), 0) + 1
        elapsed_ms, longest = elapsed_ms + _plan_ms(plan), max(longest, plan.cycle_ms)
        done, in_flight = _advance(plan, done, in_flight, planner.num_layers)
    return {"prefill_tokens_per_s": 1e3 * prompt / elapsed_ms, "decisions_by_mode": modes,
            "max_cycle_ms": longest}


def _plan_ms(plan) -> float:
    """Time until the next decision: a spatial piece may outlast its decode step. A piece
    takes its prediction times its option's prefill correction (a time-slice piece: the
    whole cycle, as the engine measures it)."""
    if plan.mode == MuxMode.SPATIAL:
        return max(plan.cycle_ms, plan.prefill.predicted_ms * plan.prefill_calibration)
    return plan.cycle_ms * plan.prefill_calibration


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
                prefill: dict[str, float] | None = None) -> MuxPlanner:
    """``prefill``: each option's prefill correction, as serving would have learned it."""
    model = OnlineCalibration(predictor)
    model.mixed_correction = correction
    model.prefill_corrections.update(prefill or {})
    config = MuxPlannerConfig(itl_slo_ms=itl_ms, max_prefill_tokens=24576,
                              **{name: name in sharing for name in MUX_SHARING})
    return MuxPlanner(model, SPLITS, config)


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
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if bool(args.predictor) == bool(args.timeline):
        parser.error("give exactly one of --predictor (a prediction) and --timeline")
    if args.timeline:
        return delivered(args.timeline, args.out)
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


def delivered(timeline: str, out: str) -> int:
    """Writes and prints what each option of a measured run delivered to prefill."""
    opener = gzip.open if timeline.endswith(".gz") else open
    with opener(timeline, "rt") as f:
        entries = json.load(f)
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
