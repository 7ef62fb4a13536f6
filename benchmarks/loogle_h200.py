"""The LooGLE-like comparison on one GPU: each configuration's server in turn, one client.

For every configuration: start ``python -m pdserve serve`` with its flags, drive it with
``benchmarks/loadgen_loogle.py`` (the client that also ran against SGLang) at each rate, read
``/v1/engine/info`` and, for multiplexing, ``/v1/engine/timeline``, stop the server. Each
(configuration, rate) writes one JSON beside the others: the client's summary and per-request
records, SLO attainment (TTFT <= 15 s and TPOT <= 60 ms), what the engine says it ran, and
the multiplexing timeline summarised (time per mode, decode cycle over the ITL target,
measured over predicted cycle).

    export PDSERVE_GIT_REVISION=<commit>   # where the tree was copied: the commit it came from
    python benchmarks/loogle_h200.py --configs multiplex,chunk1024 --rates 0.5 \
        --profile --out results/loogle

``--profile`` fits the multiplexing predictor first (``pdserve profile``, ~1.5 min on the
H200) into the output folder; ``--predictor FILE`` reuses one. ``--model tiny --device cpu``
with a few short prompts checks the set-up on any machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout

from pdserve.bench.report import (  # noqa: E402
    check_gpu,
    expected_gpu,
    pdserve_environment,
    portable_command,
    revision_fields,
)
from pdserve.bench.timeline import piece_times, prefill_delivery  # noqa: E402
from pdserve.config import ran_explicitly  # noqa: E402
from pdserve.testing import start_serve  # noqa: E402

SPLITS = "16,24,32,48,64"
CONFIGS = {
    # The engine's defaults, with the workload's TTFT SLO (since bcac187 the defaults plan
    # mixed steps past the ITL target while a prompt is predicted to miss it).
    "multiplex": "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens 24576 "
                 f"--mux-decode-sms {SPLITS} --ttft-slo-ms 15000",
    # The ablation: mixed steps only (an ITL-aware chunked prefill), no SM partitions.
    "multiplex-temporal": "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens 24576 "
                          f"--mux-decode-sms {SPLITS} --mux-sharing temporal",
    # Each option's prefill correction converging on its pieces' measured over predicted time
    # (the default compounding rule walked the time slices' factor to its 0.5 bound at 3edb18c
    # while their pieces ran 0.95-1.05 of the profile, so time slices were weighed at twice
    # their rate), or learning from each batch's delivered rate.
    "multiplex-converging": "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens "
                            f"24576 --mux-decode-sms {SPLITS} --mux-prefill-correction converging",
    "multiplex-delivery": "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens "
                          f"24576 --mux-decode-sms {SPLITS} --mux-prefill-correction delivery",
    # Plans aimed at 95% of the ITL target instead of 90% (the profile predicts +2-3% prefill).
    "multiplex-m95": "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens 24576 "
                     f"--mux-decode-sms {SPLITS} --mux-itl-margin 0.95",
    # Mixed steps that fit the 256-token prefill-step graphs weighed as an option of their own
    # (the graphs' size pinned: their default is 512 tokens since 16e4d0f).
    "multiplex-graph": "--schedule multiplex --itl-slo-ms 60 --max-num-batched-tokens 24576 "
                       f"--mux-decode-sms {SPLITS} --mux-graph-step-tokens 256 "
                       "--piecewise-graph-max-tokens 256",
    "chunk256": "--schedule chunked --chunk-size 256",
    "chunk512": "--schedule chunked --chunk-size 512",
    "chunk1024": "--schedule chunked --chunk-size 1024",
    "chunk2048": "--schedule chunked --chunk-size 2048",
    "prefill-first": "--schedule prefill-first --max-num-batched-tokens 24576",
}
# The ablations name the sharing options and prefill rule their records ran (the engine's
# defaults until time slices became opt-in and the converging rule the default); "multiplex"
# follows the engine's defaults.
CONFIGS = {name: ran_explicitly(args) if name.startswith("multiplex-") else args
           for name, args in CONFIGS.items()}
# The defaults with each mixed step's tokens, the decodes' included, aligned to 64 (mixed
# steps 1-3 tokens past a graph bucket replay the whole next bucket): follows the defaults.
CONFIGS["multiplex-aligned"] = CONFIGS["multiplex"] + " --mux-align-step-tokens"
# The same aligned to 128 tokens, the GEMMs' row tile (a step of 257-384 tokens pays for 384).
CONFIGS["multiplex-aligned128"] = CONFIGS["multiplex-aligned"] + " --mux-token-align 128"
# The same planned to 0.95 of the ITL target: 128-aligned steps rounded down to a whole
# tile left 11% of the target unused at the median (6a43faf).
CONFIGS["multiplex-aligned128-margin95"] = (CONFIGS["multiplex-aligned128"]
                                          + " --mux-itl-margin 0.95")
# SLO-aware admission (--prefill-order slo: Moore-Hodgson on the 15 s TTFT SLO) against the
# same configuration in arrival order; chunked prefill takes the same order, so the pair
# compares the schedules and not the orders.
for _name in ("multiplex", "multiplex-aligned128", "multiplex-aligned128-margin95",
              "chunk256", "chunk512", "chunk1024"):
    CONFIGS[f"{_name}-slo"] = (CONFIGS[_name] + " --prefill-order slo"
                               + ("" if "--ttft-slo-ms" in CONFIGS[_name]
                                  else " --ttft-slo-ms 15000"))
TTFT_SLO_S, TPOT_SLO_S = 15.0, 0.060


def get_json(url: str) -> dict | list:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def server_flags(args, name: str) -> list[str]:
    flags = CONFIGS[name].split() + ["--load-format", "dummy", "--max-model-len",
                                     str(args.max_model_len)]
    if name.startswith("multiplex") and args.predictor:
        flags += ["--mux-predictor", args.predictor]
    if args.device != "auto":
        flags += ["--device", args.device]
    return flags + args.server_flags.split()


def run_config(args, name: str, out: Path) -> None:
    flags = server_flags(args, name)
    server = start_serve(args.model, *flags, timeout_s=args.start_timeout,
                         log_path=out / f"{name}_server.log")
    command = ["python", "-m", "pdserve", "serve", args.model, *flags]
    try:
        for rate in args.rates:
            run_rate(args, name, rate, server.url, command, out)
    finally:
        server.stop()


def run_rate(args, name: str, rate: float, url: str, command: list[str], out: Path) -> None:
    records = out / f"{name}_rate{rate}_records.json"
    client = [sys.executable, str(HERE / "loadgen_loogle.py"), "--api", "openai", "--url", url,
              "--model", args.model, "--num-requests", str(args.num_requests), "--rate",
              str(rate), "--input-min", str(args.input_min), "--input-max",
              str(args.input_max), "--output-len", str(args.output_len), "--vocab",
              str(args.vocab), "--warmup", "--seed", "0", "--label", f"{name}_{rate}",
              "--out", str(records)]
    since = time.monotonic()
    subprocess.run(client, check=True, cwd=ROOT)
    result = json.loads(records.read_text())
    info = get_json(url + "/v1/engine/info")
    row = {"command": _portable(["python", str(HERE / "loogle_h200.py"), *sys.argv[1:]]),
           "config": name, "rate": rate, **revision_fields(), "device": info.get("device"),
           "server_command": _portable(command), "client_command": _portable(client),
           "environment_variables": pdserve_environment(), "engine_info": info,
           "summary": result["summary"],
           "attainment": attainment(result["requests"], args.output_len)}
    if name.startswith("multiplex"):
        entries = get_json(url + "/v1/engine/timeline")["entries"]
        row["timeline"] = summarise_timeline(entries, since, info.get("itl_slo_ms") or 60.0)
        (out / f"{name}_rate{rate}_timeline.json").write_text(json.dumps(
            [e for e in entries if e["time"] >= since]))
    (out / f"{name}_rate{rate}.json").write_text(json.dumps(row, indent=2))
    print(json.dumps({k: row[k] for k in ("config", "rate", "attainment")} |
                     {"ttft_p50_ms": row["summary"]["ttft_ms"]["p50"],
                      "tpot_p99_ms": row["summary"]["tpot_ms"]["p99"],
                      "input_tok_s": row["summary"]["input_throughput"]}), flush=True)


def _portable(command: list[str]) -> str:
    return " ".join(part.replace(str(ROOT) + "/", "") for part in portable_command(command))


def attainment(requests: list[dict], output_len: int) -> float:
    met = sum(1 for r in requests if r.get("ok") and r["ttft"] <= TTFT_SLO_S and
              (r["e2e"] - r["ttft"]) / max(1, output_len - 1) <= TPOT_SLO_S)
    return met / len(requests) if requests else 0.0


def summarise_timeline(entries: list[dict], since: float, itl_ms: float) -> dict:
    """Wall time per mode (each decision lasts until the next), per mode the measured
    decode cycle over the ITL target and over the prediction (medians, p90), and per
    sharing option what prefill really got against the rate the planner chose it by."""
    entries = [e for e in entries if e["time"] >= since]
    seconds: dict[str, float] = {}
    for entry, following in zip(entries, entries[1:], strict=False):
        seconds[entry["mode"]] = seconds.get(entry["mode"], 0.0) + following["time"] - \
            entry["time"]
    cycles: dict[str, dict] = {}
    for mode in sorted({e["mode"] for e in entries}):
        measured = [e for e in entries if e["mode"] == mode and e["measured_cycle_ms"] > 0
                    and e["predicted_cycle_ms"] > 0]
        if measured:
            use = sorted(e["measured_cycle_ms"] / itl_ms for e in measured)
            ratio = [e["measured_cycle_ms"] / e["predicted_cycle_ms"] for e in measured]
            cycles[mode] = {"n": len(measured), "cycle_over_itl_p50": statistics.median(use),
                            "cycle_over_itl_p90": use[int(0.9 * (len(use) - 1))],
                            "measured_over_predicted_p50": statistics.median(ratio),
                            "calibration_p50": statistics.median(
                                e.get("calibration", 1.0) for e in measured),
                            "calibration_last": measured[-1].get("calibration", 1.0)}
            device = [e["measured_device_ms"] / e["predicted_cycle_ms"] for e in measured
                      if e.get("measured_device_ms", 0) > 0]
            if device:  # the launch on the GPU's clock, what the calibration learns from
                cycles[mode]["device_over_predicted_p50"] = statistics.median(device)
    spatial = [e["decode_sms"] for e in entries if e["mode"] == "spatial"]
    return {"decisions": len(entries), "seconds_by_mode": seconds, "decode_cycle": cycles,
            "spatial_decode_sms": {str(s): spatial.count(s) for s in sorted(set(spatial))},
            "prefill_delivery": prefill_delivery(entries), "piece_times": piece_times(entries)}


def profile(args, out: Path) -> str:
    path = out / "predictor.json"
    command = [sys.executable, "-m", "pdserve", "profile", args.model, "--load-format",
               "dummy", "--decode-sms", SPLITS, "--out", str(path)]
    if args.device != "auto":
        command += ["--device", args.device]
    subprocess.run(command, check=True, cwd=ROOT)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="multiplex,chunk1024")
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")],
                        default=[0.5])
    parser.add_argument("--model", default="codellama-34b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=24576)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--input-min", type=int, default=12000)
    parser.add_argument("--input-max", type=int, default=20000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--profile", action="store_true", help="fit the predictor first")
    parser.add_argument("--predictor", default="", help="a fitted predictor to reuse")
    parser.add_argument("--server-flags", default="", help="more flags for every server")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=Path("loogle"))
    parser.add_argument("--expect-gpu", help="stop unless the GPU's name contains this "
                        "(default: H200 for codellama-34b, else any; 'any': no check)")
    args = parser.parse_args()
    check_gpu(expected_gpu(args.expect_gpu, args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.profile and any(n.startswith("multiplex") for n in names):
        args.predictor = profile(args, args.out)
    for name in names:
        run_config(args, name, args.out)


if __name__ == "__main__":
    main()
