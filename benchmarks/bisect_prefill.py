"""One lone prompt's prefill timed on several revisions of pdserve, one process per revision.

bench_engine's 8K prefill of codellama-34b read 0.875 s at d698fcb and 0.978 s at e0559f6
on the H200, in runs of different sessions (other flags, another process history, maybe
another GPU). Timing every revision in one call, on one GPU, with its clocks read during
each run, tells a code regression from a change of conditions.

Each revision is a folder holding that revision's ``pdserve`` package, made with git. The
folders are not part of the repository (under ``out/``, which git ignores):

    for rev in d698fcb e0559f6; do
        mkdir -p out/revs/$rev && git archive $rev pdserve | tar -x -C out/revs/$rev
        git rev-parse $rev > out/revs/$rev/REVISION
    done
    python benchmarks/bisect_prefill.py out/revs/d698fcb out/revs/e0559f6 out/revs/d698fcb \
        --model codellama-34b --tokens 8192 --out bisect_prefill.json

A folder may be named twice (first and last): the spread of its two readings is the drift
of the GPU over the call, the yardstick for the differences between revisions.

Each revision runs in a process of its own with only its folder's ``pdserve`` importable
(checked: a child that imported another copy stops). It builds the engine as bench_engine
does (dummy weights, prefill-first, overlap scheduling where the revision has it, 85% of
GPU memory, max_model_len 32769), runs the prompt once to warm up (Triton compiles, the
allocator grows), then ``--runs`` times more with fresh tokens (no prefix-cache hit), each
timed like bench_engine's prefill (host clock between two synchronizes). On a GPU it reads
the SM clock, temperature, power and throttle reasons through NVML during every timed run,
then times bf16 8192^3 GEMMs for about as long as one prefill (a sustained rate, which a
power- or heat-limited GPU lowers; bench_engine's 20-product ceiling barely does).

    python benchmarks/bisect_prefill.py TREE [TREE ...] [--model M] [--tokens N] [--runs K]
    python benchmarks/bisect_prefill.py A B --device cpu --model tiny --tokens 64   # a check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench_engine's engine settings, kept here because a child must not import this
# repository's pdserve (it runs another revision's).
ENGINE_SETTINGS = {"load_format": "dummy", "schedule": "prefill-first", "max_num_seqs": 256}
GPU_MEMORY_FRACTION = 0.85
MAX_MODEL_LEN = 32769
GEMM_SIZE = 8192


# --------------------------------------------------------------------------- parent


def revision_label(tree: Path) -> str:
    """The folder's REVISION file (``git rev-parse`` output), else the folder's name."""
    marker = tree / "REVISION"
    return marker.read_text().strip() if marker.is_file() else tree.name


def check_tree(tree: Path) -> None:
    if not (tree / "pdserve" / "__init__.py").is_file():
        raise SystemExit(f"{tree}: no pdserve package in it (make it with "
                         "`git archive REV pdserve | tar -x -C FOLDER`)")


def run_child(tree: Path, args: argparse.Namespace) -> dict:
    """One revision in a fresh process; its result, or the reason it has none."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", str(tree),
                   "--child-out", str(out), *child_flags(args)]
        # The folder first; what the path held stays behind it (wheels carried to the GPU
        # machine, say). A pdserve found before the folder's stops the child.
        path = [str(tree.resolve()), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        started = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within --child-timeout {args.child_timeout} s"}
        result = json.loads(out.read_text()) if done.returncode == 0 and out.is_file() else {
            "error": f"exit status {done.returncode}", "stderr_tail": done.stderr[-3000:]}
    result["process_s"] = round(time.perf_counter() - started, 1)
    return result


def child_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--tokens", str(args.tokens), "--runs", str(args.runs),
            "--device", args.device, "--max-model-len", str(args.max_model_len)]


def summary_row(label: str, result: dict) -> dict:
    row = {"revision": label}
    if "error" in result:
        return {**row, "error": result["error"]}
    seconds = [run["seconds"] for run in result["runs"]]
    median = statistics.median(seconds)
    row.update(median_s=median, min_s=min(seconds), max_s=max(seconds),
               tokens_per_s=result["tokens"] / median)
    clocks = [run["gpu"]["sm_clock_mhz_mean"] for run in result["runs"]
              if "sm_clock_mhz_mean" in run.get("gpu", {})]
    if clocks:
        row["sm_clock_mhz_mean"] = statistics.fmean(clocks)
    gemm = result.get("sustained_gemm", {})
    if "tflops" in gemm:
        # The prefill's FLOPs at the GEMM rate the same GPU sustained just after: what
        # bench_engine's fraction would read with a sustained instead of a burst ceiling.
        row["fraction_of_sustained_gemm"] = result["flops"] / (gemm["tflops"] * 1e12) / median
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'revision':42} {'median s':>9} {'min s':>8} {'max s':>8} {'SM MHz':>7} "
          f"{'of GEMM':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['revision']:42} ERROR {row['error']}")
            continue
        clock, share = row.get("sm_clock_mhz_mean"), row.get("fraction_of_sustained_gemm")
        print(f"{row['revision']:42} {row['median_s']:9.4f} {row['min_s']:8.4f} "
              f"{row['max_s']:8.4f} {'-' if clock is None else round(clock):>7} "
              f"{'-' if share is None else f'{share:.3f}':>8}")


def parent(args: argparse.Namespace) -> int:
    trees = [Path(tree) for tree in args.trees]
    for tree in trees:
        check_tree(tree)
    report = {"command": " ".join(["python"] + sys.argv), "model": args.model,
              "tokens": args.tokens, "runs_per_revision": args.runs, "revisions": []}
    for tree in trees:
        label = revision_label(tree)
        print(f"--- {label} ({tree})", flush=True)
        result = {"revision": label, "tree": str(tree), **run_child(tree, args)}
        report["revisions"].append(result)
        print(json.dumps(summary_row(label, result)), flush=True)
        write_json(args.out, report)  # what ran so far survives a later stop
    ran = [r for r in report["revisions"] if "device" in r]
    report["device"] = ran[0]["device"]["name"] if ran else None
    report["summary"] = [summary_row(r["revision"], r) for r in report["revisions"]]
    write_json(args.out, report)
    print_table(report["summary"])
    return 1 if any("error" in r for r in report["revisions"]) else 0


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


# --------------------------------------------------------------------------- child


class NvmlSampler:
    """Reads the GPU's SM clock, temperature, power and throttle reasons every
    ``interval_s`` on a thread, between ``start()`` and ``stop()``. A quantity this GPU or
    runtime does not report reads None and is left out of the summary."""

    def __init__(self, nvml, handle, interval_s: float = 0.01):
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_s
        # Older nvidia-ml-py names the throttle-reason query after throttling.
        self._reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.samples: list[tuple] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.samples.append(self.read())
            if self._stop.wait(self.interval_s):
                return

    def read(self) -> tuple:
        """(SM clock MHz, temperature C, power W, clocks-event reasons bitmask)."""
        nvml, handle = self.nvml, self.handle
        watts = _query(nvml.nvmlDeviceGetPowerUsage, handle)
        return (_query(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                _query(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                None if watts is None else watts / 1000.0, _query(self._reasons, handle))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return summarise_samples(self.samples)


def _query(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001  (NVMLError_NotSupported and kin: not reported here)
        return None


def summarise_samples(samples: list[tuple]) -> dict:
    """Clock, temperature and power over a run; the throttle reasons any sample showed
    (NVML's clocks-event bitmask, or-ed)."""
    if not samples:
        return {"unavailable": "no NVML sample taken"}
    clocks, temps, watts, reasons = ([v for v in column if v is not None]
                                     for column in zip(*samples, strict=True))
    summary = {"samples": len(samples)}
    if clocks:
        summary.update(sm_clock_mhz_mean=statistics.fmean(clocks), sm_clock_mhz_min=min(clocks))
    if temps:
        summary["temperature_c_max"] = max(temps)
    if watts:
        summary["power_w_mean"] = statistics.fmean(watts)
    if reasons:
        seen = 0
        for mask in reasons:
            seen |= mask
        summary["clocks_event_reasons_seen"] = seen
    unread = [name for name, values in zip(("sm_clock", "temperature", "power", "reasons"),
                                           (clocks, temps, watts, reasons), strict=True)
              if not values]
    if unread:
        summary["not_reported"] = unread
    return summary


def open_sampler(torch, device: str) -> tuple[NvmlSampler | None, dict]:
    """NVML on the GPU torch uses, and what it says of that GPU; None and the reason where
    there is none (a CPU run, no nvidia-ml-py, NVML refused): the timing goes on without."""
    if device != "cuda":
        return None, {"unavailable": f"device {device}"}
    try:
        import pynvml as nvml
    except ImportError:
        return None, {"unavailable": "pynvml (nvidia-ml-py) is not installed"}
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception as error:  # noqa: BLE001  (NVMLError: no driver access in this runtime)
        return None, {"unavailable": f"NVML: {error!r}"}
    limit = _query(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    info = {"uuid": uuid, "driver": _query(nvml.nvmlSystemGetDriverVersion),
            "power_limit_w": None if limit is None else limit / 1000.0,
            "temperature_c_idle": _query(nvml.nvmlDeviceGetTemperature, handle,
                                         nvml.NVML_TEMPERATURE_GPU)}  # fmt: skip
    return NvmlSampler(nvml, handle), info


def engine_config(args: argparse.Namespace):
    """bench_engine's settings; ``overlap_schedule`` only where this revision has it."""
    from pdserve.config import EngineConfig, SchedulerConfig

    flat = dict(ENGINE_SETTINGS, model=args.model, max_model_len=args.max_model_len)
    has_overlap = "overlap_schedule" in SchedulerConfig.__dataclass_fields__
    if has_overlap:
        flat["overlap_schedule"] = True
    if args.device == "cuda":
        flat["gpu_memory_utilization"] = GPU_MEMORY_FRACTION
    else:
        flat.update(device=args.device, dtype="float32")
    return EngineConfig.from_flat(**flat), {"overlap_schedule": has_overlap}


def prefill_flops(model, length: int) -> float:
    """bench_engine's count: every layer's weights once per token, the LM head for the last
    token only, causal attention."""
    arch = model.arch
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    linear = 2 * length * layer_params + 2 * model.lm_head.weight.numel()
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * length * length
    return linear + attention


def time_prefills(engine, torch, tokens: int, runs: int, sampler) -> list[dict]:
    """One warm-up run, then ``runs`` timed ones, each with tokens no earlier run had."""
    from pdserve.sampling_params import SamplingParams

    # bench_engine's prompt; a small vocabulary (the tiny model's) keeps it inside.
    spread = min(30000, engine.runner.model.arch.vocab_size - 70)
    prompt = [(i * 7919) % spread + 3 for i in range(tokens)]
    timed = []
    for attempt in range(runs + 1):
        engine.add_request(f"bisect-{attempt}", prompt, SamplingParams(max_tokens=1))
        synchronize(torch)
        if sampler and attempt:
            sampler.start()
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        synchronize(torch)
        seconds = time.perf_counter() - started
        if attempt:
            timed.append({"seconds": seconds, **({"gpu": sampler.stop()} if sampler else {})})
        prompt = [t + 1 for t in prompt]  # no prefix-cache hit on the next run
    return timed


def synchronize(torch) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def sustained_gemm(torch, seconds: float, sampler) -> dict:
    """bf16 GEMMs for about ``seconds`` after a short warm-up: their rate and the clocks."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    probe_started = time.perf_counter()
    a @ b
    torch.cuda.synchronize()
    repeats = max(20, int(seconds / (time.perf_counter() - probe_started)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sampler:
        sampler.start()
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    gpu = {"gpu": sampler.stop()} if sampler else {}
    elapsed_ms = start.elapsed_time(end)
    return {"repeats": repeats, "seconds": elapsed_ms / 1e3,
            "tflops": 2 * GEMM_SIZE**3 * repeats / elapsed_ms / 1e9, **gpu}


def check_package_origin(module_file: str, tree: Path) -> None:
    """Stops a child whose ``pdserve`` is not its revision's (an installed copy that
    shadows PYTHONPATH would time the wrong code under the right label)."""
    if not Path(module_file).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"imported pdserve from {module_file}, not from {tree}: a copy "
                         "installed on the path shadows the revision folder")


def device_info(torch, args: argparse.Namespace) -> dict:
    """What ran it: the GPU (or CPU), the libraries, and the host kernel (machines of one
    kind may differ in runtime)."""
    info = {"name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
            or args.device, "torch": torch.__version__, "python": platform.python_version(),
            "host_kernel": platform.release()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def child(args: argparse.Namespace) -> None:
    import torch

    import pdserve
    from pdserve.engine.core import EngineCore

    tree = Path(args.child)
    check_package_origin(pdserve.__file__, tree)
    sampler, gpu = open_sampler(torch, args.device)
    config, supported = engine_config(args)
    started = time.perf_counter()
    engine = EngineCore(config)
    result = {"device": {**device_info(torch, args), "gpu": gpu}, "pdserve": pdserve.__file__,
              "startup_s": time.perf_counter() - started, "tokens": args.tokens,
              "settings": supported, "flops": prefill_flops(engine.runner.model, args.tokens)}
    result["runs"] = time_prefills(engine, torch, args.tokens, args.runs, sampler)
    if args.device == "cuda":
        longest = max(run["seconds"] for run in result["runs"])
        result["sustained_gemm"] = sustained_gemm(torch, longest, sampler)
    if hasattr(engine, "close"):  # older revisions have no close
        engine.close()
    write_json(args.child_out, result)


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="*", help="folders each holding one revision's pdserve")
    parser.add_argument("--model", default="codellama-34b")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up one")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--child-timeout", type=float, default=300.0,
                        help="seconds one revision's process may take")
    parser.add_argument("--out", default="bisect_prefill.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is None and not args.trees:
        parser.error("name at least one revision folder")
    if args.tokens < 1 or args.runs < 1:
        parser.error("--tokens and --runs must be at least 1")
    if args.tokens >= args.max_model_len:
        parser.error(f"--tokens {args.tokens} needs --max-model-len above it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
