"""PD-multiplexing on one GPU: profile, fit the latency predictor, then a co-running run.

1. Profiles the model (dummy weights) with ``pdserve.engine.profiler``: decode steps and
   prefill pieces per SM split, alone and co-running, and whole-GPU mixed steps; fits
   the predictor, reports its held-out error and saves it where ``--schedule multiplex``
   finds it (``--profile-dir``).
2. For each ITL SLO given, a run on the same engine with the fitted predictor: a decode
   batch (16 requests at 8K context) runs alone, then a 16K-token prompt arrives and is
   prefilled beside it. Reports decode step times against the ITL SLO (alone and while
   prefilling), prefill throughput (prompt tokens over its time to first token), the SM
   splits the planner chose, and the online mixed-step correction it ended with. The same
   run with spatial sharing off (mixed steps only, i.e. chunked prefill sized by the
   predictor) is the baseline.

    python benchmarks/bench_multiplex.py --model codellama-34b --itl-slo-ms 40,60 --out mux.json
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pdserve.bench.report import revision_fields
from pdserve.engine.core import EngineCore
from pdserve.engine.profiler import QUICK_GRID, ProfileGrid, engine_for_profile, profile_engine
from pdserve.engine.setup import gpu_name
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.sched.predictor import LatencyPredictor


def place_decoding(engine: EngineCore, batch: int, context: int, tag: str) -> list[str]:
    """Requests at ``context`` tokens put straight into the running set (their KV pages hold
    whatever the pool holds; the kernels read every byte all the same)."""
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    vocab = engine.arch.vocab_size
    ids = []
    for i in range(batch):
        request = Request(f"{tag}-{i}", [(i * 31 + j) % (vocab - 3) + 3 for j in range(context)],
                          params)
        if not engine.blocks.grow(request, context):
            raise RuntimeError("KV pool too small for the decode batch")
        request.num_computed, request.status = context - 1, RequestStatus.RUNNING
        engine.requests[request.request_id] = request
        engine.scheduler.running.append(request)
        ids.append(request.request_id)
    return ids


def decode_gaps(engine: EngineCore, decode_ids: set[str], until) -> tuple[list[float], dict]:
    """Steps until ``until(updates)`` is True; returns gaps (ms) between consecutive tokens
    of each decode request, and the time each other request got its first token."""
    last: dict[str, float] = {}
    gaps, first = [], {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        updates = engine.step()
        for update in updates:
            if update.request_id in decode_ids and update.new_token_ids:
                if update.request_id in last:
                    gaps.append((update.time - last[update.request_id]) * 1e3)
                last[update.request_id] = update.time
            elif update.new_token_ids and update.request_id not in first:
                first[update.request_id] = update.time
        if until(first, gaps):
            break
    return gaps, first


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"n": len(values), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "mean": float(a.mean())}


def co_running_run(engine: EngineCore, decode_batch: int, context: int, prompt_tokens: int,
                   slo_ms: float, tag: str) -> dict:
    decode_ids = set(place_decoding(engine, decode_batch, context, tag))
    alone, _ = decode_gaps(engine, decode_ids, lambda first, gaps: len(gaps) >= 8 * decode_batch)
    vocab = engine.arch.vocab_size
    prompt = [(j * 7919) % (vocab - 3) + 3 for j in range(prompt_tokens)]
    started = time.monotonic()
    engine.add_request(f"{tag}-prefill", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    during, first = decode_gaps(engine, decode_ids, lambda first, gaps: bool(first))
    ttft = first[f"{tag}-prefill"] - started if first else float("nan")
    window = engine.timeline(since=started)
    for request_id in decode_ids:
        engine.abort_request(request_id)
    while engine.has_work():
        engine.step()
    return {
        "decode_batch": decode_batch, "context": context, "prompt_tokens": prompt_tokens,
        "itl_slo_ms": slo_ms,
        "decode_step_ms_alone": percentiles(alone),
        "decode_step_ms_while_prefilling": percentiles(during),
        "share_of_steps_within_slo": float(np.mean(np.asarray(during) <= slo_ms))
        if during else None,
        "prefill_ttft_s": ttft, "prefill_tokens_per_s": prompt_tokens / ttft,
        "splits_chosen": dict(collections.Counter(
            f"{e['mode']}:{e['decode_sms']}/{e['prefill_sms']}" for e in window)),
        "piece_layers": dict(collections.Counter(e["prefill_layers"] for e in window
                                                 if e["prefill_tokens"])),
        "timeline": window[:400],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="codellama-34b")
    parser.add_argument("--out", default="bench_multiplex.json")
    parser.add_argument("--profile-dir", default=None,
                        help="Where the predictor is saved (default: the engine's default).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--itl-slo-ms", default="60",
                        help="ITL SLOs to run at, comma-separated (one profile for all).")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=16000)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a plumbing check only.")
    parser.add_argument("--quick", action="store_true", help="The profiler's tiny grid.")
    args = parser.parse_args()

    import torch

    grid = QUICK_GRID if args.quick else ProfileGrid()
    slos = [float(s) for s in args.itl_slo_ms.split(",")]
    options = dict(load_format="dummy", device=args.device, itl_slo_ms=slos[0])
    if args.device != "cpu":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["dtype"] = "float32"
    started = time.perf_counter()
    engine = engine_for_profile(args.model, grid, max_model_len=args.prompt_tokens + 64,
                                **options)
    startup_s = time.perf_counter() - started
    out_dir = Path(args.profile_dir) if args.profile_dir else None
    profile = profile_engine(engine, grid, out_dir)
    print(json.dumps(asdict(profile), indent=1), flush=True)
    predictor = LatencyPredictor.load(profile.path)
    result = {
        "command": " ".join(sys.argv), **revision_fields(),
        "device": gpu_name(engine.runner.device), "torch": torch.__version__,
        "python": platform.python_version(), "model": args.model,
        "startup_s": startup_s, "partitions": repr(engine.scheduler.partitions),
        "profile": asdict(profile),
    }
    result["runs"] = []
    for slo in slos:
        modes = {"multiplex": {}} if args.skip_baseline else {
            "multiplex": {}, "temporal_only": {"spatial": False}}
        entry = {"itl_slo_ms": slo}
        for name, overrides in modes.items():
            # A fresh planner (and online calibration) per run: runs do not share state.
            engine.scheduler.set_predictor(predictor, itl_slo_ms=slo, **overrides)
            entry[name] = co_running_run(engine, args.decode_batch, args.context,
                                         args.prompt_tokens, slo, f"{name}-{slo:g}")
            entry[name]["mixed_correction"] = engine.scheduler.model.mixed_correction
            print(json.dumps({k: v for k, v in entry[name].items() if k != "timeline"},
                             indent=1), flush=True)
        result["runs"].append(entry)
    result["total_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
