"""Simulated: a fleet of P/D groups (10,000 instances in 100+ scenarios by default) behind
several gateways, under tidal traffic (``pdserve/sim/fleet.py`` over the group simulator of
``pdserve/sim/cluster.py``: the real admission rule, offer order, wait line and ratio
controller's judgement; service times fitted to a measured ``bench_engine.py`` result).

Comparisons P/D-Serve reports, each a row: ``--compare dispatch`` (on-demand forwarding
against least-connections and round-robin), ``ratio`` (the dynamic P/D ratio against the
static one it starts from: one fleet-wide split), ``pool`` (a group per scenario against
one pool of the same instances serving every scenario), ``multiplex`` (pure P/D groups
against groups of PD-multiplexing instances: two fixed slowdowns from a
``bench_multiplex.py`` result, or with ``--multiplex-model-from`` the planner model of a
``sim_validate_instance.py`` run). ``--compare none`` runs one
configuration and reports how long the simulation took (CPU seconds, one core).

These are a model's predictions, not measurements.

    python benchmarks/sim_fleet.py --trace path/to/conversation_trace.jsonl \\
        --engine-results benchmarks/results/engine_h200_codellama34b.json \\
        --compare dispatch --duration-s 600 --out benchmarks/results/sim_fleet_dispatch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim_pd_dispatch import kv_bytes_per_token  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.cluster.config import RatioConfig  # noqa: E402
from pdserve.cluster.dispatch import DISPATCH  # noqa: E402
from pdserve.sim import compiled  # noqa: E402
from pdserve.sim.cluster import LatencyModel, Multiplexing  # noqa: E402
from pdserve.sim.fleet import FleetSim, Lengths, plan_fleet  # noqa: E402

COMPARISONS = ("none", "dispatch", "ratio", "pool", "multiplex")


def configurations(compare: str) -> list[dict]:
    """The rows of one comparison: FleetSim options plus the plan's fleet-wide split."""
    if compare == "dispatch":
        return [{"dispatch": d} for d in DISPATCH]
    if compare == "ratio":
        return [{"fleet_split": True, "dynamic": False}, {"fleet_split": True, "dynamic": True}]
    if compare == "pool":
        return [{"pooled": False}, {"pooled": True}]
    if compare == "multiplex":  # no controller on either: a multiplexing group has no ratio
        return [{"multiplex": False, "dynamic": False}, {"multiplex": True, "dynamic": False}]
    return [{"dynamic": True}]


def latency_model(args: argparse.Namespace) -> LatencyModel:
    return LatencyModel.from_engine_results(args.engine_results, kv_bytes_per_token(args.model),
                                            link_gb_per_s=args.link_gb_per_s)


def build_fleet(args: argparse.Namespace, model: LatencyModel, lengths: Lengths,
                labels: dict) -> FleetSim:
    """One row's fleet (``labels``: one of ``configurations``)."""
    share = args.fleet_prefill_share if labels.get("fleet_split") else None
    plan = plan_fleet(model, lengths, args.instances, args.scenarios, args.peak_load, share,
                      args.period_s, seed=args.seed)
    return FleetSim(plan, model, lengths, dispatch=labels.get("dispatch", "on-demand"),
                    ttft_slo_s=args.ttft_slo_s, max_wait_s=args.max_wait_s,
                    num_gateways=args.gateways,
                    ratio=RatioConfig() if labels.get("dynamic", True) else None,
                    pooled=labels.get("pooled", False),
                    multiplexing=multiplexing(args, model) if labels.get("multiplex") else None,
                    seed=args.seed)


def run_row(args: argparse.Namespace, model: LatencyModel, lengths: Lengths,
            labels: dict) -> dict:
    fleet = build_fleet(args, model, lengths, labels)
    # CPU time on a shared host grows with the other work on it: the load goes with it.
    load_start = os.getloadavg()
    wall, cpu = time.monotonic(), time.process_time()
    summary = fleet.run(args.duration_s)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    host_load = {"start": load_start, "end": os.getloadavg(), "cpus": os.cpu_count()}
    moves = sum(len(g.moves) for g in fleet.distinct_groups())
    row = {**labels, "multiplex_model": fleet.multiplexing and fleet.multiplexing.model,
           "num_instances": fleet.num_instances,
           "scenarios": len(fleet.plan.scenarios),
           "moves": moves, "sim_cpu_s": cpu, "sim_wall_s": wall,
           "host_load_1_5_15_min": host_load, **summary}
    print(labels, f"{summary['requests']} requests: attainment "
          f"{summary['slo_attainment']:.1%}, TTFT P99 {summary['ttft_p99_s']:.2f} s, "
          f"{moves} moves; {cpu:.0f} s CPU", flush=True)
    return row


def multiplexing(args: argparse.Namespace, model: LatencyModel) -> Multiplexing:
    if args.multiplex_model_from:
        return planner_multiplexing(args.multiplex_model_from)
    return Multiplexing.from_multiplex_results(args.multiplex_results, model,
                                               args.multiplex_itl_slo_ms)


def planner_multiplexing(validation_path: str) -> Multiplexing:
    """A multiplexing instance on the planner model (``PlannerShare``) of a
    ``sim_validate_instance.py`` run, as its ``--resimulate`` builds it: the predictor the
    instance served with, walked with the corrections its engine learned over the probes,
    each option's pieces timed as the probes measured them, and the delivered factor fitted
    on the run's own probe. Its factors are ratios to a prompt or a decode step alone, so
    they carry over to the fleet's own latency model."""
    from benchmarks.sim_validate_instance import recorded_multiplexing  # heavy imports

    multiplexing = recorded_multiplexing(validation_path)
    if multiplexing is None:
        raise SystemExit(f"{validation_path}: no planner model (a roofline schedule, or no "
                         "interference probe recorded)")
    return multiplexing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="Mooncake-format jsonl: lengths.")
    parser.add_argument("--engine-results", required=True, help="bench_engine.py JSON.")
    parser.add_argument("--model", default="codellama-34b", help="Preset: KV bytes per token.")
    parser.add_argument("--compare", choices=COMPARISONS, default="none")
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--period-s", type=float, default=3600.0, help="Tide period.")
    parser.add_argument("--peak-load", type=float, default=0.8,
                        help="Prefill utilisation of each group at its peak rate.")
    parser.add_argument("--fleet-prefill-share", type=float, default=0.6,
                        help="--compare ratio: the one split every group starts from.")
    parser.add_argument("--ttft-slo-s", type=float, default=5.0)
    parser.add_argument("--max-wait-s", type=float, default=60.0)
    parser.add_argument("--link-gb-per-s", type=float, default=25.0)
    parser.add_argument("--multiplex-results",
                        default="benchmarks/results/bench_multiplex_h200.json",
                        help="--compare multiplex: bench_multiplex.py result the slowdowns of "
                        "a multiplexing instance come from.")
    parser.add_argument("--multiplex-itl-slo-ms", type=float, default=40.0,
                        help="Which of its runs.")
    parser.add_argument("--multiplex-model-from", metavar="VALIDATION.json",
                        help="--compare multiplex: the planner model of a multiplexing "
                        "instance, from a sim_validate_instance.py result (validated against "
                        "a real instance there), instead of --multiplex-results' two fixed "
                        "slowdowns.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    model = latency_model(args)
    lengths = Lengths.from_trace(args.trace)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["latency_model"] = dataclasses.asdict(model)  # (a compiled one has no __dict__)
    header = result_header(config)  # before the run: the revision that ran
    rows = [run_row(args, model, lengths, labels) for labels in configurations(args.compare)]
    # Compiled or not (setup.py's PDSERVE_COMPILE_SIM=1): the same figures, other CPU seconds.
    result = {**header, "kind": "simulation", "num_instances": rows[0]["num_instances"],
              "compiled": compiled(), "rows": rows}
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
