"""Where a decode step's time and the GPU's memory go, for one model on one GPU.

Records the engine's memory accounting at start-up (weights and context in use, the
measured activation peak, decode-graph memory, KV pool), times decode steps replayed as
CUDA graphs and run eagerly, and sums the GPU time of every kernel of eager decode steps
(torch profiler), so a step that misses its roofline shows which kernels take the time.
Also counts the kernels one decode layer launches: a middle layer replayed on the inputs it
had in an eager step, by the profiler (every CUDA kernel, cuBLAS's own included) and from
the Python side (``pdserve.ops.launch_count``, the count ``count_launches.py`` makes on CPU).

    python benchmarks/profile_decode.py --model llama3-8b --batch 1 --context 1024 --out p.json
    python benchmarks/profile_decode.py --model codellama-34b --decode-gemv on --out p.json
    python benchmarks/profile_decode.py --model llama3-8b --fused-rope-decode on --out p.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import (  # noqa: E402, I001
    StartupLog, kv_bytes_per_token, pdserve_environment, place_decoding_requests,
    revision_fields,
    weight_bytes)

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.core import EngineCore  # noqa: E402
from pdserve.ops.launch_count import count_calls  # noqa: E402
from pdserve.ops.triton_attention import (  # noqa: E402
    FUSED_ROPE_DECODE_ENV, ONE_LAUNCH_DECODE_ENV)


def time_steps(engine: EngineCore, steps: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / steps


def profile_kernels(fn: Callable[[], object], calls: int, unit: str) -> list[dict]:
    """GPU time and launches of every CUDA kernel per call of ``fn`` (per ``unit`` in the
    keys), slowest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[event.name[:90]]
            entry[0] += event.device_time_total / 1e3 / calls
            entry[1] += 1 / calls
    return sorted(({"kernel": k, f"ms_per_{unit}": v[0], f"launches_per_{unit}": v[1]}
                   for k, v in per_kernel.items()), key=lambda r: -r[f"ms_per_{unit}"])


def kernel_breakdown(engine: EngineCore, steps: int) -> dict:
    rows = profile_kernels(engine.step, steps, "step")
    return {"kernel_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "launches_per_step": sum(r["launches_per_step"] for r in rows), "top": rows[:20]}


def layer_launches(engine: EngineCore, calls: int) -> dict:
    """Kernels of one decode layer (eager), replayed on the inputs it had in a real step:
    the layer's forward, or its fused form when the step ran ``--decode-gemv on``."""
    layers = engine.runner.model.model.layers
    layer = layers[len(layers) // 2]  # a middle layer: it has a residual to add
    captured: dict[str, tuple] = {}
    hook = layer.register_forward_pre_hook(lambda _, args: captured.setdefault("args", args))
    fused = layer.forward_gemv

    def capture_fused(*args: object) -> object:
        captured["gemv_args"] = args
        return fused(*args)

    layer.forward_gemv = capture_fused
    try:
        engine.step()
    finally:
        hook.remove()
        del layer.forward_gemv  # the class's method again

    @torch.inference_mode()
    def call() -> object:  # rewrites the same K/V into the same slots: no state changes
        if "gemv_args" in captured:
            return layer.forward_gemv(*captured["gemv_args"])
        return layer(*captured["args"])

    rows = profile_kernels(call, calls, "layer")
    python_side = count_calls(call, calls)
    return {"layer": len(layers) // 2,
            "launches_per_layer": sum(r["launches_per_layer"] for r in rows),
            "kernel_ms_per_layer": sum(r["ms_per_layer"] for r in rows), "kernels": rows,
            "python_side_launches_per_layer": python_side.total / calls,
            "python_side_by_name": python_side.per_call(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--memory-fraction", type=float, default=0.85)
    parser.add_argument("--out", default="profile_decode.json")
    parser.add_argument("--decode-gemv", choices=("off", "on"), default="off",
                        help="the engine's --decode-gemv (fused GEMVs for batches <= 8)")
    parser.add_argument("--fused-rope-decode", choices=("off", "on"), default="off",
                        help="rotary + K/V store inside the decode attention kernel "
                             f"(sets {FUSED_ROPE_DECODE_ENV} for the engine)")
    args = parser.parse_args()
    os.environ[FUSED_ROPE_DECODE_ENV] = "1" if args.fused_rope_decode == "on" else "0"
    config = EngineConfig.from_flat(model=args.model, load_format="dummy",
                                    schedule="prefill-first", decode_gemv=args.decode_gemv,
                                    gpu_memory_utilization=args.memory_fraction)
    with StartupLog() as collect:
        engine = EngineCore(config)
    free, total = torch.cuda.mem_get_info()
    report = {"command": " ".join(["python"] + sys.argv), **revision_fields(),
              "environment_variables": pdserve_environment(),
              "device": torch.cuda.get_device_name(), "model": args.model,
              "decode_layers": engine.runner.decode_layers,
              "fused_rope_decode": args.fused_rope_decode,
              "one_launch_decode_env": os.environ.get(ONE_LAUNCH_DECODE_ENV, ""),
              "startup_log": collect.lines, "memory_fraction": args.memory_fraction,
              "total_gib": total / 2**30, "free_after_start_gib": free / 2**30,
              "weights_gib": weight_bytes(engine) / 2**30,
              "kv_pool_tokens": engine.blocks.num_blocks * engine.blocks.block_size,
              "kv_pool_gib": engine.blocks.num_blocks * engine.blocks.block_size
              * kv_bytes_per_token(engine) / 2**30}
    place_decoding_requests(engine, args.batch, args.context)
    time_steps(engine, 3)
    report["graph_step_ms"] = time_steps(engine, 20)
    for pool in engine.runner.pools.values():  # eager from here: the profiler sees every kernel
        pool.graphs.clear()
    time_steps(engine, 3)
    report["eager_step_ms"] = time_steps(engine, 20)
    report["eager_kernels"] = kernel_breakdown(engine, 5)
    report["decode_layer"] = layer_launches(engine, 5)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    layer = report["decode_layer"]
    print(json.dumps({k: v for k, v in report.items() if k not in ("eager_kernels",
                                                                   "decode_layer")}, indent=1))
    print(json.dumps({k: layer[k] for k in ("launches_per_layer", "kernel_ms_per_layer",
                                            "python_side_launches_per_layer")}))
    for row in report["eager_kernels"]["top"][:12]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
