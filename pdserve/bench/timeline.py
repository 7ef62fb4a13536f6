"""Timeline sources: what the server reports about its batches, polled during a run.

Pluggable because engines expose this differently: ``PrometheusTimeline`` reads gauges
from ``/metrics`` (running / waiting requests, batch sizes, SM split once the engine
reports it); ``JsonTimeline`` reads a flat JSON object of numbers from any endpoint.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from pathlib import Path
from typing import Protocol

import aiohttp

from pdserve.bench.report import load_json

DEFAULT_PATTERN = r"running|waiting|batch|sm|queue|kv_cache_usage"
"""Metric names worth plotting; histogram parts and counters are skipped."""

_SKIP_SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


class TimelineSource(Protocol):
    async def sample(self, session: aiohttp.ClientSession) -> dict[str, float]: ...


def parse_prometheus(text: str, pattern: str = DEFAULT_PATTERN) -> dict[str, float]:
    """Gauge samples whose name matches ``pattern``, keyed ``name{labels}``."""
    wanted = re.compile(pattern)
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        if name.endswith(_SKIP_SUFFIXES) or not wanted.search(name):
            continue
        try:
            out[name + (labels or "")] = float(value)
        except ValueError:
            continue
    return out


class PrometheusTimeline:
    def __init__(self, url: str, pattern: str = DEFAULT_PATTERN) -> None:
        self.url = url
        self.pattern = pattern

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(self.url) as resp:
            return parse_prometheus(await resp.text(), self.pattern)


class JsonTimeline:
    def __init__(self, url: str) -> None:
        self.url = url

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, float]:
        async with session.get(self.url) as resp:
            data = await resp.json()
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}


def make_source(url: str) -> TimelineSource:
    """``/metrics``-style URLs are Prometheus text; anything else is read as JSON."""
    if url.rstrip("/").endswith("/metrics"):
        return PrometheusTimeline(url)
    return JsonTimeline(url)


async def poll(source: TimelineSource, interval_s: float, stop: asyncio.Event,
               t0: float) -> list[dict]:
    """Samples ``source`` every ``interval_s`` until ``stop``; times relative to ``t0``."""
    samples: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=max(1.0, interval_s * 4))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            try:
                values = await source.sample(session)
                samples.append({"t": time.perf_counter() - t0, **values})
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass  # a missed sample is a gap in the plot, not a failed run
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
    return samples


# --------------------------------------------------- multiplexing: prefill delivered

SHARING_MODES = ("spatial", "time_slice")
"""Modes whose prefill runs as pieces of a batch beside decode."""


def option_of(entry: dict) -> str:
    """A multiplex timeline entry's option: ``spatial:<decode SMs>`` or its mode."""
    return f"spatial:{entry['decode_sms']}" if entry["mode"] == "spatial" else entry["mode"]


def prefill_batches(entries: list[dict]) -> list[dict]:
    """Each prefill batch a multiplex timeline ran in pieces (spatial, time slicing, alone
    on the whole GPU), with the prompt tokens it prefilled over the wall time it took and
    the rate the planner chose its first piece by.

    A batch is a run of decisions with the same ``prefill_batch`` number (timelines that
    predate it: the same prefill tokens; the planner's view of a batch's cached context can
    move between its pieces, on the Mooncake trace from 0 to 512 after the first); it
    starts at its first decision and ends when its last piece was seen complete
    (``measured_piece_ms``, where the timeline has it) or else at the next decision that is
    not one of its own: then it counts up to one decode step after its last layer."""
    batches: list[dict] = []
    for i, group in _batch_runs(entries):
        following = entries[i].get("time") if i < len(entries) else None
        batches.append(_batch_summary(group, following))
    return batches


def _batch_runs(entries: list[dict]):
    """(index after the run, the run) for each run of one batch's decisions."""
    run: list[dict] = []
    for i, entry in enumerate(entries):
        key = _batch_key(entry)
        if run and key == _batch_key(run[0]):
            run.append(entry)
            continue
        if run:
            yield i, run
        run = [entry] if key is not None else []
    if run:
        yield len(entries), run


def _batch_key(entry: dict) -> int | None:
    if entry["mode"] not in (*SHARING_MODES, "prefill_only") or \
            entry.get("prefill_tokens", 0) <= 0:
        return None
    return entry.get("prefill_batch") or entry["prefill_tokens"]


def _batch_summary(group: list[dict], following: float | None) -> dict:
    start = group[0]["time"]
    done = [e["time"] + e["measured_piece_ms"] / 1e3 for e in group
            if e.get("measured_piece_ms", 0.0) > 0]
    end = max(done) if done else (following if following is not None else group[-1]["time"])
    options: dict[str, int] = {}
    for entry in group:
        options[option_of(entry)] = options.get(option_of(entry), 0) + 1
    tokens, seconds = group[0]["prefill_tokens"], max(end - start, 1e-9)
    sharing = [option_of(e) for e in group if e["mode"] in SHARING_MODES]
    switches = sum(a != b for a, b in zip(sharing, sharing[1:], strict=False))
    return {"start": start, "seconds": seconds, "tokens": tokens, "options": options,
            "option": _dominant(options), "switches": switches,
            "realized_tokens_per_s": tokens / seconds,
            "committed_tokens_per_s": group[0].get("committed_tokens_per_s", 0.0)}


def _dominant(options: dict[str, int]) -> str:
    """The option most of a batch's decisions ran under; prefill alone only if alone."""
    sharing = {k: n for k, n in options.items() if k != "prefill_only"} or options
    return max(sorted(sharing), key=lambda k: sharing[k])


def prefill_delivery(entries: list[dict]) -> dict[str, dict]:
    """Per option: prompt tokens prefilled per second of wall time, realized against the
    rate the planner chose by, over the batches that option ran most of (``prefill_batches``)
    and, for mixed steps (``temporal``), over runs of consecutive mixed steps."""
    by_option: dict[str, list[dict]] = {}
    for batch in prefill_batches(entries) + mixed_runs(entries):
        by_option.setdefault(batch["option"], []).append(batch)
    return {option: _delivery(batches) for option, batches in sorted(by_option.items())}


def mixed_runs(entries: list[dict]) -> list[dict]:
    """Runs of consecutive mixed steps: their prompt tokens over the time from the first
    step's decision to the next decision of another kind (or the last step's end)."""
    runs, run = [], []
    for entry in [*entries, None]:
        if entry is not None and entry["mode"] == "temporal" and entry.get("prefill_tokens"):
            run.append(entry)
            continue
        if run:
            end = entry["time"] if entry is not None else \
                run[-1]["time"] + run[-1]["measured_cycle_ms"] / 1e3
            runs.append(_mixed_summary(run, end))
        run = []
    return runs


def _mixed_summary(run: list[dict], end: float) -> dict:
    tokens, seconds = sum(e["prefill_tokens"] for e in run), max(end - run[0]["time"], 1e-9)
    predicted_s = sum(e["prefill_tokens"] / e["committed_tokens_per_s"] for e in run
                      if e.get("committed_tokens_per_s", 0.0) > 0)
    return {"start": run[0]["time"], "seconds": seconds, "tokens": tokens,
            "options": {"temporal": len(run)}, "option": "temporal", "switches": 0,
            "realized_tokens_per_s": tokens / seconds,
            "committed_tokens_per_s": tokens / predicted_s if predicted_s > 0 else 0.0}


def _delivery(batches: list[dict]) -> dict:
    tokens = sum(b["tokens"] for b in batches)
    seconds = sum(b["seconds"] for b in batches)
    predicted_s = sum(b["tokens"] / b["committed_tokens_per_s"] for b in batches
                      if b["committed_tokens_per_s"] > 0)
    realized = tokens / seconds
    committed = tokens / predicted_s if predicted_s > 0 else 0.0
    return {"batches": len(batches), "tokens": tokens, "seconds": round(seconds, 3),
            "switches": sum(b["switches"] for b in batches),
            "realized_tokens_per_s": round(realized), "committed_tokens_per_s": round(committed),
            "realized_over_committed": round(realized / committed, 3) if committed else None}


def piece_times(entries: list[dict]) -> dict[str, dict]:
    """Per option, each piece's measured time from issue to completion over its predicted
    one: count and nearest-rank median and p90 (timelines that record pieces only)."""
    ratios: dict[str, list[float]] = {}
    for entry in entries:
        if entry.get("piece_launched") and entry.get("measured_piece_ms", 0.0) > 0 \
                and entry["predicted_piece_ms"] > 0:
            ratio = entry["measured_piece_ms"] / entry["predicted_piece_ms"]
            ratios.setdefault(option_of(entry), []).append(ratio)
    return {option: _quantiles(values) for option, values in sorted(ratios.items())}


def _quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    rank = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
    return {"n": len(ordered), "measured_over_predicted_p50": round(rank(0.5), 3),
            "measured_over_predicted_p90": round(rank(0.9), 3)}


def load_engine_timeline(path: str | Path) -> list[dict]:
    """An engine timeline's entries (``EngineCore.timeline()``, as the benchmarks keep it),
    from JSON or gzipped JSON."""
    return load_json(path)


def timeline_beside(record_path: str | Path) -> Path:
    """Where a benchmark record keeps its engine timeline: ``<record>_timeline.json.gz``."""
    record_path = Path(record_path)
    return record_path.with_name(record_path.stem + "_timeline.json.gz")
