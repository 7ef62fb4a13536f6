"""The first GPU baseline: chunked prefill (256..8192) and prefill-first, ShareGPT-like and
LooGLE-like, CodeLlama-34B with dummy weights on one H200.

Each configuration's server is started once and runs both workloads (after two unmeasured
warm-up requests each), then is stopped before the next one takes the GPU. Sized for a
tight device budget:

- sharegpt: 150 requests at 6 req/s (Poisson): ~25 s of arrivals + ~15 s for the last
  outputs; ~40 requests decoding at once, real decode pressure without saturating the GPU.
- loogle: 20 requests at 0.3 req/s (Poisson): ~65 s + ~5 s; prompts 10K-16K tokens (clipped
  to the preset's 16,384-token context), ~2 s of prefill each: 60-70% prefill load, the
  regime where PD-multiplexing is meant to hold TPOT while prefill keeps up.
- SLOs: TPOT 60 ms for both; TTFT 2 s (sharegpt) and 15 s (loogle). The P99 of all ITL
  gaps is reported beside attainment.

Measured with --smoke on the H200: a server is healthy ~25 s after launch. Expected: ~2.5 min
per configuration, ~17 min for all seven. A device command may run at most 10 minutes, so
run three groups (each under ~8 min) and merge:

    export PDSERVE_GIT_REVISION=<commit>
    python benchmarks/run_baseline.py --configs chunk256,chunk512,chunk1024 --out A.json
    python benchmarks/run_baseline.py --configs chunk2048,chunk4096,chunk8192 --out B.json
    python benchmarks/run_baseline.py --configs prefill-first --out C.json
    python -m pdserve.bench plot A.json B.json C.json --out baseline.json --plot-dir plots

``--smoke`` runs two configurations on a few requests (~2 min) to check the set-up first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runnable from a plain checkout: the package sits one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.cli import main as bench_main  # noqa: E402

CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
CONFIGS = {f"chunk{c}": f"--schedule chunked --chunk-size {c}" for c in CHUNKS}
# Prefill-first must fit a whole LooGLE prompt in one step.
CONFIGS["prefill-first"] = "--schedule prefill-first --max-num-batched-tokens 16384"
# PD-multiplexing against the same SLO; it needs a fitted predictor (`pdserve profile`, or
# benchmarks/bench_multiplex.py) in $PDSERVE_PROFILE_DIR or ~/.cache/pdserve/profiles.
CONFIGS["multiplex"] = "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens 16384"
# PD-disaggregation in the same engine: a static split, decode on 56 of the 132 SMs (the
# README's example; on the H200 a 16 x 8K decode step on 64 SMs ran 14% over the whole GPU).
CONFIGS["disagg"] = "--schedule disagg --disagg-decode-sms 56 --max-num-batched-tokens 16384"

WORKLOADS = {
    "full": ("sharegpt:num=150,rate=6,ttft_slo_ms=2000",
             "loogle:num=20,rate=0.3,max_context=16384,ttft_slo_ms=15000"),
    "smoke": ("sharegpt:num=24,rate=6,ttft_slo_ms=2000",
              "loogle:num=3,rate=0.3,max_context=16384,ttft_slo_ms=15000"),
}


def build_argv(args: argparse.Namespace) -> list[str]:
    names = ["chunk512", "prefill-first"] if args.smoke else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    argv = ["compare", "--model", args.model, "--port", str(args.port),
            "--itl-slo-ms", "60", "--vocab-size", "32000", "--seed", "0",
            "--startup-timeout-s", "900", "--timeline-interval-ms", "250",
            "--out", args.out, "--plot-dir", args.out.removesuffix(".json") + "_plots"]
    for name in names:
        argv += ["--config", f"{name}={CONFIGS[name]}"]
    for spec in WORKLOADS["smoke" if args.smoke else "full"]:
        argv += ["--workload", spec]
    if args.server_args:
        argv += ["--server-arg", args.server_args]
    return argv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="codellama-34b")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"Comma-separated subset of: {', '.join(CONFIGS)}.")
    parser.add_argument("--out", help="Default: benchmarks/results/baseline_chunked.json "
                        "(baseline_smoke.json with --smoke).")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--server-args", default="", help="Extra args for every server.")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="Print the bench command only.")
    args = parser.parse_args()
    name = "baseline_smoke" if args.smoke else "baseline_chunked"
    args.out = args.out or f"benchmarks/results/{name}.json"
    argv = build_argv(args)
    if args.dry_run:
        print("python -m pdserve.bench " + " ".join(repr(a) if " " in a else a for a in argv))
        return 0
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
