"""A decode layer's GEMMs under each BLAS backend torch can call, on one GPU.

The engine's linear layers are ``F.linear`` (cuBLAS, torch's default backend). At a few
rows cuBLAS's heuristic splits K for some projections and adds a reduction kernel after
them (codellama-34b at batch 1: 96 reductions a step, 0.20 ms of an 18.1 ms step, and the
QKV GEMM at 89% of the copy rate where gate/up runs at 95%). torch also calls cuBLASLt for
the same op (``torch.backends.cuda.preferred_blas_library("cublaslt")``), whose heuristic
picks its own kernels; cuBLASLt's workspace is set by ``CUBLASLT_WORKSPACE_SIZE`` (KiB) at
start-up, so a workspace is compared by running this script again under the variable (the
result records it).

For each projection of a model (QKV, o_proj, gate_up, down, the LM head) and each row count,
times ``F.linear`` under each backend as a CUDA-graph replay (no launch cost between
calls, as the engine's decode graphs), with the kernels one call launches (names from the
profiler), the weight bytes over time, and the copy bandwidth measured in the same run
(``ceilings.copy_gbs``, as bench_kernels.py measures it). ``step_ms`` adds the layer's
projections times the layers and the LM head once: the GEMMs of one decode step.

    python benchmarks/bench_blas.py --model codellama-34b --rows 1,8,64,256 \\
        --out benchmarks/results/blas_<gpu>_codellama34b_<revision>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_kernels import measure_ceilings
from triton.testing import do_bench_cudagraph

from pdserve.bench.report import revision_fields
from pdserve.model.arch import PRESETS, ModelArch

DTYPE = torch.bfloat16
BACKENDS = ("cublas", "cublaslt")
# The variables that change which kernels cuBLAS and cuBLASLt pick (workspace sizes).
BLAS_VARIABLES = ("CUBLASLT_WORKSPACE_SIZE", "CUBLAS_WORKSPACE_CONFIG")


def projections(arch: ModelArch) -> dict[str, tuple[int, int, int]]:
    """Name -> (N, K, calls a step) of a decode step's GEMMs at one rank."""
    hidden, inter, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    return {"qkv": (arch.q_size + 2 * arch.kv_size, hidden, layers),
            "o_proj": (hidden, arch.q_size, layers),
            "gate_up": (2 * inter, hidden, layers),
            "down": (hidden, inter, layers),
            "lm_head": (arch.vocab_size, hidden, 1)}


def time_us(fn: Callable[[], object]) -> float:
    fn()  # let the backend pick and load its kernel outside the graph
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50) * 1e3


def kernels_of(fn: Callable[[], object]) -> list[str]:
    """The GPU kernels one call launches, in order (names cut to 100 characters)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name[:100] for e in sorted(events, key=lambda e: e.time_range.start)]


def bench_case(n: int, k: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    weight = torch.randn(n, k, generator=gen, device="cuda", dtype=DTYPE) * k ** -0.5
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=DTYPE)
    weight_bytes = weight.numel() * weight.element_size()
    row: dict = {"n": n, "k": k, "rows": rows, "weight_bytes": weight_bytes}
    reference = None
    for backend in BACKENDS:
        torch.backends.cuda.preferred_blas_library(backend)
        fn = lambda: F.linear(x, weight)  # noqa: E731
        out = fn()
        if reference is None:
            reference = out
        else:  # another backend must compute the same product
            torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)
        us = time_us(fn)
        row[backend] = {"us": us, "gbs": weight_bytes / us / 1e3, "kernels": kernels_of(fn)}
    torch.backends.cuda.preferred_blas_library("cublas")
    row["cublaslt_over_cublas"] = row["cublaslt"]["us"] / row["cublas"]["us"]
    return row


def step_sums(rows: list[dict], arch: ModelArch) -> dict:
    """Per row count and backend: the step's GEMM milliseconds (each projection's time times
    its calls a step) and the best of both per projection."""
    calls = {name: c for name, (_, _, c) in projections(arch).items()}
    sums: dict = {}
    for count in sorted({r["rows"] for r in rows}):
        at = [r for r in rows if r["rows"] == count]
        entry = {b: sum(r[b]["us"] * calls[r["projection"]] for r in at) / 1e3
                 for b in BACKENDS}
        entry["best_of_both"] = sum(min(r[b]["us"] for b in BACKENDS) * calls[r["projection"]]
                                    for r in at) / 1e3
        sums[str(count)] = entry
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="codellama-34b", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="1,8,64,256", help="comma-separated row counts")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_blas.py times GPU kernels: no CUDA device here")
    arch = PRESETS[args.model]
    report = {"command": " ".join(["python"] + sys.argv), **revision_fields(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(),
              "model": args.model,
              "blas_environment": {v: os.environ[v] for v in BLAS_VARIABLES if v in os.environ},
              "ceilings": measure_ceilings(), "rows": []}
    print(json.dumps(report["ceilings"]), flush=True)
    for name, (n, k, _) in projections(arch).items():
        for rows in (int(r) for r in args.rows.split(",")):
            row = {"projection": name, **bench_case(n, k, rows)}
            report["rows"].append(row)
            print(json.dumps({key: row[key] for key in ("projection", "rows")}
                             | {b: round(row[b]["us"], 2) for b in BACKENDS}
                             | {f"{b}_kernels": len(row[b]["kernels"]) for b in BACKENDS}),
                  flush=True)
            torch.cuda.empty_cache()
    report["step_ms"] = step_sums(report["rows"], arch)
    print(json.dumps(report["step_ms"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
