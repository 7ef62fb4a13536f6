"""Timeline sources: what the server reports about its batches, polled during a run.

Pluggable because engines expose this differently: ``PrometheusTimeline`` reads gauges
from ``/metrics`` (running / waiting requests, batch sizes, SM split once the engine
reports it); ``JsonTimeline`` reads a flat JSON object of numbers from any endpoint.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Protocol

import aiohttp

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
