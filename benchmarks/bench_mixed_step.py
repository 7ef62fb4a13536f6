"""Whole-GPU steps with prompt tokens: eager vs graph segments, against their kernels' time.

Each case is one step of the real runner: a prefill chunk of P tokens after a prefix of C
tokens already in the KV cache, plus D decodes at context X (a mixed step of chunked prefill
or of multiplexing's temporal option). Timed the way serving runs it, from the host's first
line of the step to its sampled tokens on the host, as the median of repeats:

- eager: every kernel launched from Python;
- piecewise: CUDA graphs between the attentions (``pdserve/engine/piecewise.py``);
- kernel sum: the GPU time of the eager step's kernels (torch profiler), the floor a step
  reaches once launching costs nothing.

    python benchmarks/bench_mixed_step.py --model codellama-34b --out mixed_step.json
    python benchmarks/bench_mixed_step.py --grid --repeats 5 --out mixed_step_grid.json
    python benchmarks/bench_mixed_step.py --cases 384:12288:2:4096 --extend-splits 1,0,1
    python benchmarks/bench_mixed_step.py --cases 255:10240:1:16384,287:10240:1:16384 --kernels 12

``--extend-splits`` times every case once per value of ``PDSERVE_EXTEND_KV_SPLITS`` (the
extend kernel's prefix splits: 1, a power of two, or 0 for the rule that fills the last
wave), one after another in the same process, so an A/B of the rule meets the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from bench_engine import place_decoding_requests

from pdserve.bench.report import pdserve_environment, revision_fields
from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams
from pdserve.sched.base import MAIN_POOL, Plan

# (prefill tokens, prefix tokens, decodes, decode context)
CASES = ((512, 0, 64, 1024), (448, 0, 1, 16384), (256, 8192, 2, 16384), (1024, 0, 0, 0),
         (64, 0, 16, 4096), (128, 4096, 4, 8192), (2048, 0, 0, 0))
# ``--grid``: chunk x prefix x decode batch (4K context each), for the chunked instance
# model's mixed step, which is too fast where the weight read and the compute are close
# and over long prefixes (docs/cluster.md, "The chunked model held out").
GRID_CHUNKS, GRID_PREFIXES, GRID_DECODES = (64, 128, 256, 384, 512, 1024), (0, 4096, 16384), \
    (1, 8, 32)
GRID_CONTEXT = 4096


def parse_cases(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """``--cases``: comma-separated ``tokens:prefix:decodes:context`` steps (a step one token
    past a graph bucket beside the same step on it, say); a ValueError naming a bad one."""
    found = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 4 or not all(part.isdigit() for part in parts):
            raise ValueError(f"--cases {item!r}: want tokens:prefix:decodes:context")
        found.append(tuple(int(part) for part in parts))
    return tuple(found)


def cases(grid: bool, decodes: tuple[int, ...] = GRID_DECODES,
          context: int = GRID_CONTEXT) -> tuple[tuple[int, int, int, int], ...]:
    """The named cases, or with ``grid`` chunk x prefix x decode batch (``decodes``, each
    decode over ``context`` tokens)."""
    if not grid:
        return CASES
    return tuple((chunk, prefix, batch, context) for chunk in GRID_CHUNKS
                 for prefix in GRID_PREFIXES for batch in decodes)


def place_prefill(engine: EngineCore, tokens: int, prefix: int) -> Request:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    vocab = engine.arch.vocab_size
    prompt = [(i * 7919) % (vocab - 3) + 3 for i in range(prefix + tokens)]
    request = Request(f"p{tokens}-{prefix}", prompt, params)
    engine.blocks.grow(request, prefix + tokens)
    request.num_computed = prefix
    request.status = RequestStatus.RUNNING
    engine.requests[request.request_id] = request
    return request


def step_plan(engine: EngineCore, case: tuple[int, int, int, int]) -> tuple[Plan, list]:
    tokens, prefix, decodes, context = case
    placed = place_decoding_requests(engine, decodes, context) if decodes else []
    if placed is None:
        raise RuntimeError(f"KV pool too small for {decodes} x {context}")
    plan = Plan()
    for request in placed:
        plan.add(request, 1)
    prefill = place_prefill(engine, tokens, prefix)
    plan.add(prefill, tokens)
    return plan, [*placed, prefill]


def wall_ms(engine: EngineCore, plan: Plan, repeats: int) -> float:
    for _ in range(3):
        engine.runner.execute(plan)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.runner.execute(plan)  # waits for the sampled tokens, as a synchronous step does
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def kernel_sum_ms(engine: EngineCore, plan: Plan) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.runner.execute(plan)
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        total_us += getattr(event, "self_device_time_total", None) or \
            getattr(event, "self_cuda_time_total", 0.0)
    return total_us / 1e3


def parse_splits(text: str) -> tuple[str, ...]:
    """``--extend-splits``: comma-separated values of the split variable, each 0 or a power
    of two; a ValueError naming a bad one."""
    values = tuple(item.strip() for item in text.split(","))
    for value in values:
        if not value.isdigit() or int(value) & (int(value) - 1):
            raise ValueError(f"--extend-splits {value!r}: want 0 (auto) or a power of two")
    return values


def use_extend_splits(value: str) -> None:
    """Point the extend kernel at ``value`` splits from the next launch on (the variable is
    read once and cached; each arm warms up its own kernels in ``wall_ms``)."""
    from pdserve.ops.triton_attention import EXTEND_SPLITS_ENV, _extend_splits_from_env

    os.environ[EXTEND_SPLITS_ENV] = value
    _extend_splits_from_env.cache_clear()


def rule_launches(engine: EngineCore, case) -> list[dict] | None:
    """The extend launches the auto rule makes for ``case``'s chunk (one sequence): each
    one's prefix splits, q heads per tile row block and first row (a second one is the
    tail launch); None off a GPU, where the torch reference attends without splits."""
    arch, device = engine.arch, engine.runner.device
    if device.type != "cuda":
        return None
    import dataclasses

    from pdserve.ops.triton_attention import (
        LaunchShape,
        default_extend_config,
        plan_extend_launches,
    )

    config = dataclasses.replace(default_extend_config(arch.head_dim, device), kv_splits=0)
    shape = LaunchShape(arch.num_heads, 1, case[1], device)
    launches = plan_extend_launches(config, case[0], arch.num_heads // arch.num_kv_heads,
                                    shape)  # fmt: skip
    return [{"splits": x.splits, "row_heads": x.row_heads, "row_start": x.row_start}
            for x in launches]


def measure(engine: EngineCore, case, repeats: int, kernels: int = 0) -> dict:
    plan, placed = step_plan(engine, case)
    pool = engine.runner.pools[MAIN_POOL]
    segments, row = pool.piecewise, dict(zip(("prefill_tokens", "prefix", "decodes",
                                              "decode_context"), case, strict=True))
    pool.piecewise = None
    row["eager_ms"] = wall_ms(engine, plan, repeats)
    row["kernel_sum_ms"] = kernel_sum_ms(engine, plan)
    if kernels:  # which kernels a step size's cost is in (the eager step's)
        from profile_decode import profile_kernels

        row["kernels"] = profile_kernels(lambda: engine.runner.execute(plan), 3,
                                         "step")[:kernels]
    pool.piecewise = segments
    if segments is not None and len(plan.scheduled) and case[0] + case[2] <= segments.max_tokens:
        row["piecewise_ms"] = wall_ms(engine, plan, repeats)
        row["piecewise_over_kernel_sum"] = row["piecewise_ms"] / row["kernel_sum_ms"]
    row["eager_over_kernel_sum"] = row["eager_ms"] / row["kernel_sum_ms"]
    for request in placed:
        engine.blocks.free(request)
        engine.requests.pop(request.request_id, None)
        engine.runner.forget(request.request_id)
        if request in engine.scheduler.running:
            engine.scheduler.running.remove(request)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="codellama-34b")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="mixed_step.json")
    parser.add_argument("--grid", action="store_true",
                        help="time chunk x prefix x decode batch steps (54 by default) "
                        "instead of the seven named cases")
    parser.add_argument("--grid-decodes", default=",".join(map(str, GRID_DECODES)),
                        help="with --grid: the decode batches (comma-separated; served "
                        "ShareGPT-like mixed steps carry ~60-200 decodes)")
    parser.add_argument("--grid-context", type=int, default=GRID_CONTEXT,
                        help="with --grid: each decode's context in tokens (the batches "
                        "times it must fit the KV pool beside the prompt)")
    parser.add_argument("--cases", type=parse_cases, default=None,
                        help="time these steps instead: comma-separated "
                        "tokens:prefix:decodes:context")
    parser.add_argument("--extend-splits", type=parse_splits, default=None,
                        help="time each case once per value of PDSERVE_EXTEND_KV_SPLITS "
                        "(comma-separated: 1, a power of two, 0 = fill the last wave)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="record each case's N slowest kernels (GPU time per eager "
                        "step, launches), to tell which kernel a step size's cost is in")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="the engine's memory budget (codellama-34b on an 80 GB card "
                        "needs ~0.95 for a KV pool)")
    args = parser.parse_args()
    grid_decodes = tuple(int(n) for n in args.grid_decodes.split(","))
    config = EngineConfig.from_flat(model=args.model, load_format="dummy", schedule="chunked",
                                    chunk_size=2048, max_model_len=24576, max_num_seqs=256,
                                    gpu_memory_utilization=args.gpu_memory_utilization)
    engine = EngineCore(config)
    segments = engine.runner.pools[MAIN_POOL].piecewise
    report = {"command": " ".join(["python"] + sys.argv), **revision_fields(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "model": args.model,
              "piecewise_buckets": segments.buckets if segments else None,
              "environment_variables": pdserve_environment(), "cases": []}
    for case in args.cases or cases(args.grid, grid_decodes, args.grid_context):
        for splits in args.extend_splits or (None,):
            if splits is not None:
                use_extend_splits(splits)
            row = measure(engine, case, args.repeats, args.kernels)
            if splits is not None:
                row["extend_kv_splits_env"] = splits
                row["rule_launches"] = rule_launches(engine, case)
            print(json.dumps(row), flush=True)
            report["cases"].append(row)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
