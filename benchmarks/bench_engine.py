"""Engine speed on one GPU: decode step time and prefill throughput beside their rooflines.

Decode: requests with a given context are placed straight into the running set (their KV
pages hold whatever the pool holds; the kernels read every byte all the same), then the real
engine loop (schedule -> CUDA-graph step -> sample -> update) is timed. Roofline: weight bytes
plus KV bytes read, over the measured copy bandwidth. Prefill: one prompt through the real
loop; roofline: FLOPs over the measured bf16 GEMM rate; with NVML (nvidia-ml-py), the SM
clock, temperature and power during the timed run (``gpu``), which a 20-product ceiling
cannot show for a second-long run. Also reports the host-side share of a
decode step and the KV pool size at the configured memory fraction.

Each decode point runs with overlap scheduling (the next step planned and issued while the
GPU runs this one) and without (``--overlap both``, the default); the overlapped row carries
``host_hidden_ms``, the step time the overlap removed, beside ``host_ms``, the host work per
step (schedule + batch build + update).

    python benchmarks/bench_engine.py --models llama3-8b codellama-34b --out results.json

``--decode-gemv off,on`` starts the engine once per value (one after the other: two 34B
engines do not fit at once) and ends with one ``decode_gemv_speedup`` line per decode point:
step time with the flag off over step time with it on. A short A/B of the small batches:

    python benchmarks/bench_engine.py --models codellama-34b --decode-gemv off,on \
        --overlap on --decode-batches 1,2,4,8 --decode-contexts 1024 --prefill-lengths none \
        --out decode_gemv_ab.json

Serving batches hold contexts of every length: ``--decode-context-spread S`` spreads each
point's contexts evenly over context x [1 - S, 1 + S], and ``--decode-long-context N`` makes
the first one N tokens long (the roofline counts the KV bytes of the contexts placed), as
decode attention's balancing of long contexts is timed with and without
(``PDSERVE_DECODE_BALANCE_SPLITS=1``):

    python benchmarks/bench_engine.py --models codellama-34b --overlap on \
        --decode-batches 16,48,128 --decode-contexts 512 --decode-long-context 8192 \
        --prefill-lengths none --out long_context.json

With ``--tensor-parallel-size N`` the rooflines are per GPU: rank 0's shard of the weights,
its KV heads and its share of the FLOPs, against one GPU's measured ceilings (all-reduce
time is not in the roofline, so the gap to it includes communication).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass

import torch

from pdserve.bench.report import pdserve_environment, revision_fields
from pdserve.config import BLAS_LIBRARIES, EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.request import Request, RequestStatus
from pdserve.sampling_params import SamplingParams

DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 8192)
PREFILL_LENGTHS = (1024, 8192, 32768)


def measure_ceilings() -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), repeats=20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_ms = _time_ms(lambda: a @ a, repeats=20)
    return {"copy_bandwidth_gbs": 2 * (1 << 30) / copy_ms / 1e6,  # read + write
            "bf16_gemm_tflops": 2 * 8192**3 / gemm_ms / 1e9}


def _time_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def weight_bytes(engine: EngineCore) -> int:
    # The embedding table is gathered, not streamed: only the LM head's copy is read per step.
    model = engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if not engine.arch.tie_word_embeddings:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(engine: EngineCore) -> int:
    arch = engine.runner.model.arch  # this rank's KV heads
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * engine.runner.dtype.itemsize


def ragged_contexts(batch: int, context: int, spread: float,
                    long_context: int = 0) -> list[int]:
    """``batch`` contexts evenly spaced over ``context`` x [1 - spread, 1 + spread] (mean
    ``context``, the longest first), as serving holds requests at every length; 0: all
    ``context``. With ``long_context`` the first is that long instead: one long context
    beside the rest, as a serving batch often holds."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"context spread {spread}: must be in [0, 1)")
    if batch == 1 or spread == 0.0:
        contexts = [context] * batch
    else:
        contexts = [max(1, round(context * (1 + spread - 2 * spread * i / (batch - 1))))
                    for i in range(batch)]
    return [long_context, *contexts[1:]] if long_context and contexts else contexts


def place_decoding_requests(engine: EngineCore, batch: int, context: int,
                            spread: float = 0.0, long_context: int = 0) -> list[Request] | None:
    contexts = ragged_contexts(batch, context, spread, long_context)
    blocks = sum(engine.blocks.blocks_needed(c + 64) for c in contexts)
    if blocks > engine.blocks.num_free_blocks:
        return None
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    requests = []
    for i, context in enumerate(contexts):
        request = Request(f"d{batch}-{context}-{i}", [i % 1000 + 3] * context, params)
        engine.blocks.grow(request, context)
        request.num_computed = context - 1
        request.status = RequestStatus.RUNNING
        engine.requests[request.request_id] = request
        engine.scheduler.running.append(request)
        requests.append(request)
    return requests


def time_decode(engine: EngineCore, batch: int, context: int, steps: int = 12,
                spread: float = 0.0, long_context: int = 0) -> dict | None:
    requests = place_decoding_requests(engine, batch, context, spread, long_context)
    if requests is None:
        return None
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    host = _HostTimer(engine)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) * 1e3 / steps
    for request in requests:
        engine.abort_request(request.request_id)
    engine.step()
    host.restore()
    return {"step_ms": step_ms, "host_ms": host.total_ms / steps}


class _HostTimer:
    """Times the scheduler's host work per step (schedule + batch build + update)."""

    def __init__(self, engine: EngineCore):
        import pdserve.engine.model_runner as runner_module

        self.engine, self.total_ms = engine, 0.0
        self._module = runner_module
        self._schedule, self._update = engine.scheduler.schedule, engine.scheduler.update
        self._build = runner_module.build_host_batch
        engine.scheduler.schedule = self._timed(self._schedule)
        engine.scheduler.update = self._timed(self._update)
        runner_module.build_host_batch = self._timed(self._build)

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            self.total_ms += (time.perf_counter() - started) * 1e3
            return result
        return wrapper

    def restore(self) -> None:
        self.engine.scheduler.schedule, self.engine.scheduler.update = self._schedule, self._update
        self._module.build_host_batch = self._build


def time_prefill(engine: EngineCore, length: int, sampler=None) -> dict | None:
    """The second of two runs of a lone prompt of ``length`` tokens; with an NVML
    ``sampler`` (bisect_prefill.NvmlSampler), the GPU's clock, temperature and power during
    it: a compute-bound run slows with the clock, which the burst ceiling does not see."""
    if length + 1 > engine.max_model_len:
        return None
    prompt = [(i * 7919) % 30000 + 3 for i in range(length)]
    timings, gpu = [], None
    for attempt in range(2):  # the first run warms up kernels for these shapes
        timed = attempt == 1
        engine.add_request(f"p{length}-{attempt}", prompt, SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        if sampler and timed:
            sampler.start()
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
        if sampler and timed:
            gpu = sampler.stop()
        prompt = [t + 1 for t in prompt]  # no prefix-cache hit on the second run
    seconds = timings[-1]
    return {"seconds": seconds, "tokens_per_s": length / seconds,
            **({"gpu": gpu} if gpu is not None else {})}


def prefill_flops(engine: EngineCore, length: int) -> float:
    arch = engine.runner.model.arch  # this rank's heads and layer shards
    layer_params = sum(p.numel() for p in engine.runner.model.model.layers.parameters())
    head_params = engine.runner.model.lm_head.weight.numel()
    linear = 2 * length * layer_params + 2 * head_params  # logits for the last token only
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * length * length  # causal
    return linear + attention


class StartupLog(logging.Handler):
    """Collects the engine's start-up lines (memory accounting, KV pool, graph memory)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> StartupLog:
        logger = logging.getLogger("pdserve")
        self._level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("pdserve")
        logger.removeHandler(self)
        logger.setLevel(self._level)


OVERLAP_MODES = {"both": (False, True), "on": (True,), "off": (False,)}


@dataclass(frozen=True)
class Points:
    """What one engine measures: decode batch x context points, then prefill lengths."""

    decode_batches: tuple[int, ...] = DECODE_BATCHES
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS
    prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS
    # Each decode point's contexts over context x [1 - spread, 1 + spread] (``ragged_contexts``)
    context_spread: float = 0.0
    # The first context of each decode point this long instead (0: as the others)
    long_context: int = 0


def variant_speedups(results: list[dict], field: str, base: str, other: str) -> list[dict]:
    """Per model and decode point, step time with the engine's ``field`` at ``base`` over
    step time at ``other`` (above 1: ``other`` is faster); only points both runs measured."""
    timed = {}
    for result in results:
        for row in result["decode"]:
            if "step_ms" in row:
                key = (result["model"], row["batch"], row["context"], row["overlap"])
                timed[key + (row[field],)] = row
    speedups = []
    for (model, batch, context, overlap, value), first in sorted(timed.items()):
        second = timed.get((model, batch, context, overlap, other))
        if value == base and second is not None:
            speedups.append({f"{field}_speedup": first["step_ms"] / second["step_ms"],
                             "model": model, "batch": batch, "context": context,
                             "overlap": overlap, f"step_ms_{base}": first["step_ms"],
                             f"step_ms_{other}": second["step_ms"],
                             f"fraction_of_roofline_{other}": second["fraction_of_roofline"]})
    return speedups


def decode_gemv_speedups(results: list[dict]) -> list[dict]:
    """--decode-gemv off over on at each decode point (above 1: the fused path is faster)."""
    return variant_speedups(results, "decode_gemv", "off", "on")


def blas_library_speedups(results: list[dict]) -> list[dict]:
    """--blas-library cublas over cublaslt at each decode point (above 1: cuBLASLt's
    kernels are faster)."""
    return variant_speedups(results, "blas_library", "cublas", "cublaslt")


def _int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes; "none" for none."""
    return () if text == "none" else tuple(int(part) for part in text.split(","))


def _gemv_modes(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(","))
    if not modes or any(mode not in ("off", "on") for mode in modes):
        raise argparse.ArgumentTypeError(f"{text!r}: off, on, or off,on")
    return modes


def _blas_libraries(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not names or any(name not in BLAS_LIBRARIES for name in names):
        raise argparse.ArgumentTypeError(f"{text!r}: one or more of {', '.join(BLAS_LIBRARIES)}")
    return names


def decode_rows(engine: EngineCore, batch: int, context: int, overlap_modes: tuple,
                roofline_ms: float, spread: float = 0.0, long_context: int = 0) -> list[dict]:
    """One row per overlap mode. The engine is started with overlap on; turning it off for a
    measurement makes every step wait for its launch, as ``--no-overlap-schedule`` does."""
    rows = []
    for overlap in overlap_modes:
        engine.scheduler.overlap.enabled = overlap
        timing = time_decode(engine, batch, context, spread=spread, long_context=long_context)
        row = {"batch": batch, "context": context, "context_spread": spread, "overlap": overlap}
        if long_context:
            row["long_context"] = long_context
        if timing is None:
            row["skipped"] = "KV pool too small for this batch and context"
        else:
            row.update(timing, roofline_ms=roofline_ms,
                       fraction_of_roofline=roofline_ms / timing["step_ms"])
        rows.append(row)
    engine.scheduler.overlap.enabled = True
    synchronous = next((r for r in rows if not r["overlap"] and "step_ms" in r), None)
    for row in rows:
        if row["overlap"] and synchronous is not None and "step_ms" in row:
            row["host_hidden_ms"] = synchronous["step_ms"] - row["step_ms"]
    return rows


def bench_model(model: str, memory_fraction: float, ceilings: dict,
                overlap_modes: tuple = (False, True), tensor_parallel_size: int = 1,
                decode_gemv: str = "off", points: Points | None = None,
                sampler=None, blas_library: str = "cublas") -> dict:
    points = points or Points()
    config = EngineConfig.from_flat(model=model, load_format="dummy", schedule="prefill-first",
                                    overlap_schedule=True,
                                    gpu_memory_utilization=memory_fraction,
                                    tensor_parallel_size=tensor_parallel_size,
                                    decode_gemv=decode_gemv, blas_library=blas_library,
                                    max_model_len=max(PREFILL_LENGTHS) + 1, max_num_seqs=256)
    started = time.perf_counter()
    with StartupLog() as startup:
        engine = EngineCore(config)
    result = {"model": model, "tensor_parallel_size": tensor_parallel_size,
              "startup_s": time.perf_counter() - started,
              "kv_pool_tokens": engine.blocks.num_blocks * engine.blocks.block_size,
              "memory_fraction": memory_fraction, "startup_log": startup.lines,
              "decode_gemv": decode_gemv, "decode_layers": engine.runner.decode_layers,
              "blas_library": blas_library,
              "decode": [], "prefill": []}
    weights, kv_token = weight_bytes(engine), kv_bytes_per_token(engine)
    bandwidth = ceilings["copy_bandwidth_gbs"] * 1e9
    result["overlap_schedule"] = engine.describe()["overlap_schedule"]["enabled"]
    for context in points.decode_contexts:
        for batch in points.decode_batches:
            tokens = sum(ragged_contexts(batch, context, points.context_spread,
                                         points.long_context))
            roofline_ms = (weights + tokens * kv_token) / bandwidth * 1e3
            for row in decode_rows(engine, batch, context, overlap_modes, roofline_ms,
                                   points.context_spread, points.long_context):
                row["decode_gemv"], row["blas_library"] = decode_gemv, blas_library
                result["decode"].append(row)
                print(json.dumps(row), flush=True)
    for length in points.prefill_lengths:
        timing = time_prefill(engine, length, sampler)
        row = {"tokens": length}
        if timing is None:
            row["skipped"] = "longer than max_model_len"
        else:
            ideal_s = prefill_flops(engine, length) / (ceilings["bf16_gemm_tflops"] * 1e12)
            row.update(timing, roofline_s=ideal_s, fraction_of_roofline=ideal_s / timing["seconds"])
        result["prefill"].append(row)
        print(json.dumps(row), flush=True)
    engine.close()  # stops tensor-parallel workers
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "codellama-34b"])
    parser.add_argument("--memory-fraction", type=float, default=0.85)
    parser.add_argument("--out", default="bench_engine.json")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs per model (rooflines are then per GPU)")
    parser.add_argument("--overlap", choices=tuple(OVERLAP_MODES), default="both",
                        help="decode with overlap scheduling, without, or both (default)")
    parser.add_argument("--decode-gemv", type=_gemv_modes, default=("off",),
                        help="engine --decode-gemv values, one engine each: off, on, or off,on "
                        "(then speedup lines at the end)")
    parser.add_argument("--blas-library", type=_blas_libraries, default=("cublas",),
                        help="engine --blas-library values, one engine each: cublas, "
                        "cublaslt, or cublas,cublaslt (then speedup lines at the end)")
    parser.add_argument("--decode-batches", type=_int_list, default=DECODE_BATCHES)
    parser.add_argument("--decode-contexts", type=_int_list, default=DECODE_CONTEXTS)
    parser.add_argument("--decode-context-spread", type=float, default=0.0,
                        help="each decode point's contexts spread evenly over context x "
                        "[1 - S, 1 + S], same mean (serving's ragged lengths); default 0")
    parser.add_argument("--decode-long-context", type=int, default=0,
                        help="the first context of each decode point this long instead (one "
                        "long context beside the rest); default 0: as the others")
    parser.add_argument("--prefill-lengths", type=_int_list, default=PREFILL_LENGTHS,
                        help="comma-separated prompt lengths, or none")
    args = parser.parse_args()
    if len(args.decode_gemv) > 1 and len(args.blas_library) > 1:
        parser.error("compare --decode-gemv values or --blas-library values, not both at once")
    points = Points(args.decode_batches, args.decode_contexts, args.prefill_lengths,
                    args.decode_context_spread, args.decode_long_context)
    ceilings = measure_ceilings()
    print(json.dumps(ceilings), flush=True)
    from bisect_prefill import open_sampler  # beside this script, which Python puts on the path

    sampler, gpu = open_sampler(torch, "cuda")
    report = {"command": " ".join(["python"] + sys.argv), **revision_fields(),
              "environment_variables": pdserve_environment(),
              "device": torch.cuda.get_device_name(), "gpu": gpu, "torch": torch.__version__,
              "python": platform.python_version(), "ceilings": ceilings, "models": []}
    for model in args.models:
        for decode_gemv, blas_library in itertools.product(args.decode_gemv,
                                                           args.blas_library):
            report["models"].append(bench_model(model, args.memory_fraction, ceilings,
                                                OVERLAP_MODES[args.overlap],
                                                args.tensor_parallel_size, decode_gemv, points,
                                                sampler, blas_library))
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    report["decode_gemv_speedups"] = decode_gemv_speedups(report["models"])
    report["blas_library_speedups"] = blas_library_speedups(report["models"])
    for line in report["decode_gemv_speedups"] + report["blas_library_speedups"]:
        print(json.dumps(line), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
