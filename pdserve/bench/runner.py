"""One workload against one backend: a single run, or a goodput search made of runs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from pdserve.bench.client import Backend
from pdserve.bench.goodput import GoodputResult, search_goodput, sweep_goodput
from pdserve.bench.loadgen import LoadResult, run_load
from pdserve.bench.metrics import request_samples, summarize
from pdserve.bench.sharegpt import TextTokenizer
from pdserve.bench.spec import WorkloadSpec
from pdserve.bench.timeline import TimelineSource
from pdserve.bench.workloads import (
    BenchError,
    BenchRequest,
    id_range,
    random_tokens,
    salted,
    workload_stats,
)


@dataclass(frozen=True)
class SloOptions:
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None


@dataclass(frozen=True)
class GoodputOptions:
    enabled: bool = False
    rates: tuple[float, ...] = ()
    """Sweep these rates; empty: bisection from ``start_rate``."""
    start_rate: float = 1.0
    min_rate: float = 0.01
    max_rate: float = 1024.0
    rel_tol: float = 0.1
    max_probes: int = 10
    target: float = 0.9


@dataclass
class RunContext:
    progress: bool = True
    timeline: TimelineSource | None = None
    timeline_interval_s: float = 0.25
    keep_samples: bool = True
    warmup_requests: int = 0
    """Sent (and not measured) before each workload: the first requests after a start
    otherwise carry kernel JIT compilation (seconds on a GPU) into TTFT."""
    tokenizer: TextTokenizer | None = None
    """The served model's tokenizer, for workloads read from text (a ShareGPT file)."""


def _run_result(load: LoadResult, spec: WorkloadSpec, rate: float, slo: SloOptions,
                ctx: RunContext) -> dict:
    summary = summarize(load.records, load.duration_s, slo.ttft_slo_ms, slo.itl_slo_ms)
    summary["request_rate"] = "inf" if math.isinf(rate) else rate
    if ctx.keep_samples:
        summary["samples"] = request_samples(load.records, load.t0)
        summary["timeline"] = load.timeline
    return summary


async def run_at_rate(backend: Backend, spec: WorkloadSpec, requests: list[BenchRequest],
                      rate: float, slo: SloOptions, ctx: RunContext) -> dict:
    offsets = spec.offsets(requests, rate)
    desc = f"{spec.name} @ {rate:g} req/s" if not math.isinf(rate) else spec.name
    mark = await _engine_mark(backend)
    load = await run_load(backend, requests, offsets, spec.max_concurrency, ctx.progress,
                          ctx.timeline, ctx.timeline_interval_s, desc)
    if not load.timeline:
        load.timeline = _backend_timeline(backend, load.t0)
    result = _run_result(load, spec, rate, slo, ctx)
    if mark is not None and ctx.keep_samples:
        result["engine_timeline"] = await _engine_steps(backend, mark, load.t0)
    return result


async def _engine_mark(backend: Backend) -> tuple[float, float] | None:
    """(server clock, local perf_counter) at one instant, when the server keeps a timeline."""
    clock = getattr(backend, "engine_clock", None)
    server_now = await clock() if clock is not None else None
    return None if server_now is None else (server_now, time.perf_counter())


async def _engine_steps(backend: Backend, mark: tuple[float, float], t0: float) -> list[dict]:
    """The engine's own timeline of this run (decisions or steps), on the run's time axis.

    Server and client clocks are only related through ``mark`` (read at one instant), so
    this holds across hosts too, to within one request's round trip.
    """
    server_at_mark, local_at_mark = mark
    entries = await backend.engine_timeline(server_at_mark)
    shift = local_at_mark - t0 - server_at_mark
    return [{**entry, "t": entry["time"] + shift} for entry in entries]


async def run_goodput(backend: Backend, spec: WorkloadSpec, requests: list[BenchRequest],
                      slo: SloOptions, opts: GoodputOptions,
                      ctx: RunContext) -> tuple[GoodputResult, dict[float, dict]]:
    if slo.ttft_slo_ms is None and slo.itl_slo_ms is None:
        raise BenchError("a goodput search needs --ttft-slo-ms and/or --itl-slo-ms")
    runs: dict[float, dict] = {}

    async def measure(rate: float) -> tuple[float, dict]:
        # Fresh tokens per probe: the server's prefix cache still holds the previous probe's.
        probe = salted(requests, len(runs), id_range(requests, spec.vocab_size))
        runs[rate] = await run_at_rate(backend, spec, probe, rate, slo, ctx)
        return runs[rate]["slo_attainment"], _without_samples(runs[rate])

    if opts.rates:
        result = await sweep_goodput(measure, list(opts.rates), opts.target)
    else:
        result = await search_goodput(measure, opts.start_rate, opts.min_rate, opts.max_rate,
                                      opts.target, opts.rel_tol, opts.max_probes)
    return result, runs


async def warm_up(backend: Backend, requests: list[BenchRequest]) -> None:
    """Sends ``requests`` (a few tokens of output each) and waits; nothing is recorded."""
    if not requests:
        return
    # Fresh tokens of the same lengths: reusing the measured prompts would put them in the
    # prefix cache and turn the first measured prefills into cache hits.
    rng = np.random.default_rng([0xBE7C, len(requests)])
    short = [BenchRequest(random_tokens(rng, r.prompt_len, max(r.prompt_token_ids) + 1),
                          min(r.output_len, 4)) for r in requests]
    await run_load(backend, short, [0.0] * len(short), progress=False)


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _backend_timeline(backend: Backend, t0: float) -> list[dict]:
    """Steps an in-process engine recorded itself during this run (absolute times)."""
    steps = getattr(backend, "timeline", None) or []
    return [{**s, "t": s["t"] - t0} for s in steps if s["t"] >= t0]


def _without_samples(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("samples", "timeline", "engine_timeline")}


async def run_workload(backend: Backend, spec: WorkloadSpec, slo: SloOptions,
                       goodput: GoodputOptions, ctx: RunContext) -> dict:
    """The result record of one workload: metrics at the top level (``ttft_ms`` ...), the
    workload, per-request samples, and ``goodput_rps`` when a search ran."""
    requests = spec.build(ctx.tokenizer)
    slo = SloOptions(_first(spec.ttft_slo_ms, slo.ttft_slo_ms),
                     _first(spec.itl_slo_ms, slo.itl_slo_ms))
    head = {"workload": {**spec.describe(), **workload_stats(requests)}}
    await warm_up(backend, requests[:ctx.warmup_requests])
    if not goodput.enabled:
        return {**head, **await run_at_rate(backend, spec, requests, spec.request_rate, slo, ctx)}
    found, runs = await run_goodput(backend, spec, requests, slo, goodput, ctx)
    # Headline metrics: the run at the goodput rate, else the gentlest rate probed.
    shown = runs.get(found.goodput_rps) or runs[min(runs)]
    return {**head, **shown, "goodput_rps": found.goodput_rps,
            "goodput": {"target": found.target, "bracketed": found.bracketed,
                        "points": found.points}}
