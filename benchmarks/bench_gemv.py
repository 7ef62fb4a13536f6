"""The fused decode GEMVs against cuBLAS (torch's linear) on one GPU, to fill GEMV_CONFIGS.

For each projection of a model (default codellama-34b: QKV, o_proj, gate_up, down) and each
row count (1, 2, 4, 8), times ``F.linear`` and the fused GEMV that replaces it in a decode
layer (QKV and gate_up: ``rms_norm_gemv``; o_proj: ``gemv_add``; down:
``silu_mul_gemv_add``) under each candidate tile config, every one as a CUDA-graph replay
(no launch cost) and each checked against its torch reference first. Bandwidth is weight
bytes over time, beside the device-to-device copy bandwidth measured in the same run
(``ceilings.copy_gbs``, as bench_kernels.py measures it).

    python benchmarks/bench_gemv.py --out benchmarks/results/gemv_h200_codellama34b.json

Prints one JSON line per (projection, rows): cuBLAS and default-config times, every
candidate's time, the best, and its speedup over cuBLAS; then the ``GEMV_CONFIGS`` entries
of the best configs, ready to paste into ``pdserve/ops/triton_gemv.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.nn.functional as F
from bench_kernels import measure_ceilings
from triton.testing import do_bench_cudagraph

from pdserve.bench.report import revision_fields
from pdserve.model.arch import PRESETS, ModelArch
from pdserve.ops import reference, triton_gemv
from pdserve.ops.triton_gemv import GemvConfig, default_config, row_bucket

ROWS = (1, 2, 4, 8)
DTYPE = torch.bfloat16
# The broadcast form (one or two rows) and the tensor-core form (rows padded to 16).
BROADCAST = [GemvConfig(bn, bk, warps, stages) for bn, bk, warps, stages in
             [(4, 1024, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 3),
              (32, 256, 4, 3), (8, 1024, 8, 4)]]
DOT = [GemvConfig(bn, bk, warps, stages, use_dot=True) for bn, bk, warps, stages in
       [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 8, 3), (64, 128, 4, 4),
        (64, 256, 8, 3)]]


def candidates(rows: int) -> list[GemvConfig]:
    """Broadcast configs hold BLOCK_M x BLOCK_N x BLOCK_K partial sums in registers, so they
    are tried up to four rows only; the tensor-core form at every row count."""
    return (BROADCAST if row_bucket(rows) <= 4 else []) + DOT


def projections(arch: ModelArch) -> dict[str, tuple[int, int, str]]:
    """Name -> (N, K, fused op) of one decode layer's four GEMVs at one rank."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {"qkv": (arch.q_size + 2 * arch.kv_size, hidden, "rms_norm_gemv"),
            "o_proj": (hidden, arch.q_size, "gemv_add"),
            "gate_up": (2 * inter, hidden, "rms_norm_gemv"),
            "down": (hidden, inter, "silu_mul_gemv_add")}


class Case:
    """One projection at one row count: its inputs, the cuBLAS call, the fused calls."""

    def __init__(self, n: int, k: int, op: str, rows: int) -> None:
        self.n, self.k, self.op, self.rows = n, k, op, rows
        gen = torch.Generator(device="cuda").manual_seed(n + k + rows)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device="cuda", dtype=DTYPE)

        self.weight = rand(n, k) * k ** -0.5
        self.x = rand(rows, 2 * k if op == "silu_mul_gemv_add" else k)
        self.linear_x = rand(rows, k)
        self.norm_weight, self.residual = rand(k), rand(rows, n)

    def args(self) -> tuple:
        if self.op == "rms_norm_gemv":
            return (self.x, self.norm_weight, 1e-5, self.weight, None)
        return (self.x, self.weight, None, self.residual)

    def fused(self, config: GemvConfig | None) -> Callable[[], torch.Tensor]:
        fn, args = getattr(triton_gemv, self.op), self.args()
        return lambda: fn(*args, config=config)

    def cublas(self) -> Callable[[], torch.Tensor]:
        return lambda: F.linear(self.linear_x, self.weight)

    def check(self, config: GemvConfig | None) -> None:
        out = self.fused(config)()
        ref = getattr(reference, self.op)(*self.args())
        atol = 1e-2 * ref.float().abs().max().item()  # as tests/ops/test_triton_gemv.py
        torch.testing.assert_close(out, ref, atol=atol, rtol=2e-2)

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def time_us(fn: Callable[[], object]) -> float:
    fn()  # compile outside the graph
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50) * 1e3


def bench_case(case: Case) -> dict:
    row = {"n": case.n, "k": case.k, "op": case.op, "rows": case.rows,
           "cublas_us": time_us(case.cublas()), "default": asdict(default_config(case.rows))}
    case.check(None)
    row["default_us"] = time_us(case.fused(None))
    row["configs"] = []
    for config in candidates(case.rows):
        entry = asdict(config)
        try:
            case.check(config)
            entry["us"] = time_us(case.fused(config))
        except Exception as err:  # a config that fails to compile or to match is reported
            entry["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        row["configs"].append(entry)
    timed = [c for c in row["configs"] if "us" in c]
    best = min(timed, key=lambda c: c["us"]) if timed else None
    if best is not None and best["us"] < row["default_us"]:
        row["best"] = best
    else:
        row["best"] = {**row["default"], "us": row["default_us"]}
    row["best_speedup_over_cublas"] = row["cublas_us"] / row["best"]["us"]
    row["best_gbs"] = case.weight_bytes / row["best"]["us"] / 1e3
    row["cublas_gbs"] = case.weight_bytes / row["cublas_us"] / 1e3
    return row


def config_table(rows: list[dict]) -> list[str]:
    """``GEMV_CONFIGS`` entries (one line each) for the best config of every measured row."""
    lines = []
    for row in rows:
        best = {k: v for k, v in row["best"].items() if k in GemvConfig.__dataclass_fields__}
        key = (row["n"], row["k"], row_bucket(row["rows"]))
        args = ", ".join(f"{k}={v!r}" for k, v in best.items())
        lines.append(f"    {key}: GemvConfig({args}),")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="codellama-34b", choices=sorted(PRESETS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="comma-separated row counts, each at most 8")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    report = {"command": " ".join(["python"] + sys.argv), **revision_fields(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "model": args.model,
              "ceilings": measure_ceilings(), "rows": []}
    print(json.dumps(report["ceilings"]), flush=True)
    for name, (n, k, op) in projections(PRESETS[args.model]).items():
        for rows in (int(r) for r in args.rows.split(",")):
            row = {"projection": name, **bench_case(Case(n, k, op, rows))}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    report["gemv_configs"] = config_table(report["rows"])
    print("GEMV_CONFIGS = {\n" + "\n".join(report["gemv_configs"]) + "\n}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
