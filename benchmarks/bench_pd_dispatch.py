"""On-demand forwarding against blind dispatch, one P/D group behind the gateway.

P/D-Serve's claim: a gateway that places prefills by its own estimate of each instance's
load (queue length, open connections) queues requests behind long prompts while another
instance would have taken them in time; offering the request and letting the instance
refuse what it cannot start within the TTFT SLO keeps attainment up as load rises.

Each configuration is one ``pdserve cluster`` (2 prefill + 1 decode instances and the
gateway), differing only in ``--dispatch``; ``pdserve bench compare`` starts it, sweeps the
same request rates with the same seeded workload (prompt lengths spread +-90% around the
mean, so work per request varies 19x), then stops it. Attainment counts a request as met
when its TTFT is within the SLO; a request the gateway gave up on (503) is a miss.

    python benchmarks/bench_pd_dispatch.py --out benchmarks/results/pd_dispatch_cpu.json

Defaults fit the tiny model on a CPU host; on GPUs pass a real model, ``--gpus`` through
``--cluster-args`` and rates that load it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

# Runnable from a plain checkout: the package sits one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.cli import main as bench_main  # noqa: E402

DISPATCH = ("on-demand", "least-connections", "round-robin")
CLUSTER_CMD = (f"{shlex.quote(sys.executable)} -m pdserve cluster {{model}} "
               "--host 127.0.0.1 --port {port}")


def build_argv(args: argparse.Namespace) -> list[str]:
    group = (f"--prefill {args.prefill} --decode {args.decode} --ttft-slo-ms {args.ttft_slo_ms} "
             f"--max-wait-s {args.max_wait_s} --serve-args {shlex.quote(args.serve_args)} "
             f"{args.cluster_args}")
    workload = (f"random:num={args.num_prompts},input_len={args.input_len},range_ratio=0.9,"
                f"output_len={args.output_len},max_context=4096")
    argv = ["compare", "--model", args.model, "--server-cmd", CLUSTER_CMD,
            "--workload", workload, "--seed", "0", "--vocab-size", "250",
            "--ttft-slo-ms", str(args.ttft_slo_ms), "--goodput", "--goodput-rates", args.rates,
            "--timeline-path", "", "--startup-timeout-s", "600", "--out", args.out,
            "--plot-dir", args.out.removesuffix(".json") + "_plots"]
    for dispatch in args.dispatch.split(","):
        argv += ["--config", f"{dispatch}=--dispatch {dispatch} {group}"]
    return argv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dispatch", default=",".join(DISPATCH))
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--rates", default="1,2,3,4", help="Request rates to sweep (req/s).")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--ttft-slo-ms", type=float, default=1500.0)
    parser.add_argument("--max-wait-s", type=float, default=10.0)
    parser.add_argument("--serve-args", default="--device cpu --dtype float32")
    parser.add_argument("--cluster-args", default="", help="More `pdserve cluster` flags.")
    parser.add_argument("--out", default="benchmarks/results/pd_dispatch.json")
    parser.add_argument("--dry-run", action="store_true", help="Print the bench command only.")
    args = parser.parse_args()
    # One intra-op thread per engine: several instances share this host's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = build_argv(args)
    if args.dry_run:
        print("python -m pdserve.bench " + shlex.join(argv))
        return 0
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
