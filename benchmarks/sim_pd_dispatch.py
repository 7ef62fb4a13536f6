"""Simulated: on-demand forwarding against blind dispatch for one P/D group, replaying a
Mooncake trace at rising load (``pdserve/sim/cluster.py``: the real admission rule, offer
order and wait line; service times from a latency model fitted to a measured
``bench_engine.py`` result).

These are a model's predictions, not measurements: they show what the policies do with
measured service times, at a scale (many instances, an hour of traffic) no single machine
runs.

    python benchmarks/sim_pd_dispatch.py --trace path/to/conversation_trace.jsonl \\
        --engine-results benchmarks/results/engine_h200_codellama34b.json \\
        --out benchmarks/results/sim_pd_dispatch_codellama34b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.cluster.config import RatioConfig  # noqa: E402
from pdserve.cluster.dispatch import DISPATCH  # noqa: E402
from pdserve.model.arch import PRESETS  # noqa: E402
from pdserve.sim.cluster import GroupSim, LatencyModel, load_trace, summarize  # noqa: E402


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    arch = PRESETS[model]
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes


def dispatch_rows(args: argparse.Namespace, model: LatencyModel) -> list[dict]:
    rows = []
    for scale in (float(x) for x in args.rate_scales.split(",")):
        for dispatch in DISPATCH:
            requests = load_trace(args.trace, rate_scale=scale, limit=args.requests)
            sim = GroupSim(model, args.prefill, args.decode, dispatch=dispatch,
                           ttft_slo_s=args.ttft_slo_s, max_wait_s=args.max_wait_s)
            rows.append(_row(args, model, requests, sim, scale=scale, dispatch=dispatch))
    return rows


def ratio_rows(args: argparse.Namespace, model: LatencyModel) -> list[dict]:
    """Every split of the instances, static and with the controller starting from it."""
    total, rows = args.prefill + args.decode, []
    for num_prefill in range(1, total):
        for dynamic in (False, True):
            requests = load_trace(args.trace, rate_scale=args.ratio_scale, limit=args.requests)
            sim = GroupSim(model, num_prefill, total - num_prefill, ttft_slo_s=args.ttft_slo_s,
                           max_wait_s=args.max_wait_s, ratio=RatioConfig() if dynamic else None)
            row = _row(args, model, requests, sim, scale=args.ratio_scale,
                       start=f"{num_prefill}P{total - num_prefill}D", dynamic=dynamic)
            row["moves"] = [{"time_s": t, "instance": n, "role": r} for t, n, r in sim.moves]
            row["final"] = f"{len(sim.active('prefill'))}P{len(sim.active('decode'))}D"
            rows.append(row)
    return rows


def _row(args, model, requests, sim, **labels) -> dict:
    duration = max(r.arrival for r in requests)
    work = sum(model.prefill_s(r.input_len) for r in requests)
    row = {**labels, "request_rate": len(requests) / duration,
           "prefill_load": work / (duration * sim.num_prefill),
           **summarize(sim.run(requests), args.ttft_slo_s)}
    e2e = [r.finished - r.arrival for r in requests if r.finished is not None]
    row["e2e_p50_s"] = sorted(e2e)[len(e2e) // 2] if e2e else None
    print(" ".join(f"{k}={v}" for k, v in labels.items()),
          f"{row['request_rate']:.2f} req/s: attainment {row['slo_attainment']:.1%}, served "
          f"{row['success_rate']:.1%}, TTFT P50 {row['ttft_p50_s']:.2f} s P99 "
          f"{row['ttft_p99_s']:.2f} s", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="Mooncake-format jsonl.")
    parser.add_argument("--engine-results", required=True, help="bench_engine.py JSON.")
    parser.add_argument("--model", default="codellama-34b", help="Preset: KV bytes per token.")
    parser.add_argument("--requests", type=int, default=3000, help="First N trace requests.")
    parser.add_argument("--rate-scales", default="0.4,0.6,0.8,1.0,1.2,1.5",
                        help="Replay the trace this many times faster.")
    parser.add_argument("--prefill", type=int, default=6)
    parser.add_argument("--decode", type=int, default=3)
    parser.add_argument("--ttft-slo-s", type=float, default=5.0)
    parser.add_argument("--max-wait-s", type=float, default=60.0)
    parser.add_argument("--link-gb-per-s", type=float, default=25.0)
    parser.add_argument("--ratio", action="store_true",
                        help="Instead: at --ratio-scale, static P/D splits of the same "
                        "instances against the ratio controller starting from each split.")
    parser.add_argument("--ratio-scale", type=float, default=0.8)
    parser.add_argument("--out")
    args = parser.parse_args()
    model = LatencyModel.from_engine_results(args.engine_results,
                                             kv_bytes_per_token(args.model),
                                             link_gb_per_s=args.link_gb_per_s)
    rows = ratio_rows(args, model) if args.ratio else dispatch_rows(args, model)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["latency_model"] = dataclasses.asdict(model)
    if args.ratio:
        config["ratio_config"] = RatioConfig().__dict__
    result = {**result_header(config), "kind": "simulation", "rows": rows}
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
