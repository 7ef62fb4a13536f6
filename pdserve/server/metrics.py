"""Prometheus metrics of the server: request latencies observed here, engine counters read
from the latest stats snapshot the engine process sent.

Each server owns its registry (not the library's global one) so several servers, or tests,
can live in one process.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from pdserve.messages import MUX_MODES, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class RequestTiming:
    """One finished request, in ``time.monotonic()`` seconds."""

    arrival: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    finish_reason: str | None = None


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Server arrival to the engine's first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = BulkHistogram("pdserve_inter_token_latency_seconds",
                                 "Engine-side gap between two consecutive tokens of a request.",
                                 _ITL_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Server arrival to the request's last byte.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("pdserve_requests_finished", "Finished requests.",
                                ["finish_reason"], registry=r)
        self.errors = Counter("pdserve_request_errors", "Requests answered with an error.",
                              ["status"], registry=r)
        r.register(_EngineCollector(stats))

    def observe(self, timing: RequestTiming) -> None:
        if timing.first_token is not None:
            self.ttft.observe(max(0.0, timing.first_token - timing.arrival))
        times = timing.token_times
        self.itl.observe_many([b - a for a, b in zip(times, times[1:], strict=False)])
        if timing.finished is not None:
            self.e2e.observe(timing.finished - timing.arrival)
        self.finished.labels(timing.finish_reason or "abort").inc()

    def count_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BulkHistogram:
    """A histogram fed many values at once. prometheus_client's ``observe`` takes a lock and
    scans the buckets for each value (about 1.5 us); a finished request brings one value per
    token, and requests of a closed-loop load finish in bursts on the event loop."""

    def __init__(self, name: str, doc: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # buckets are "less than or equal"
        self.sum += sum(values)

    def collect(self) -> Iterable[Metric]:
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _EngineCollector:
    """Reads the engine's counters at scrape time from the last snapshot."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        yield _gauge("pdserve_num_requests_running", "Requests in the running batch.",
                     s.num_running)
        yield _gauge("pdserve_num_requests_waiting", "Requests waiting to be scheduled.",
                     s.num_waiting)
        yield _gauge("pdserve_kv_cache_usage_ratio", "Share of KV pages in use (0..1).",
                     s.kv_usage)
        yield _gauge("pdserve_kv_cache_free_blocks", "Free KV pages.", s.num_free_blocks)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0
        yield _gauge("pdserve_prefix_cache_hit_rate",
                     "Prompt tokens found in the prefix cache / prompt tokens looked up.", hit_rate)
        yield _counter("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                       "cache.", s.prefix_cache_queries)
        yield _counter("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       s.prefix_cache_hits)
        yield _counter("pdserve_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield _counter("pdserve_generation_tokens", "Tokens generated.",
                       s.generation_tokens_total)
        yield _counter("pdserve_num_preemptions", "Requests preempted (KV pages reclaimed).",
                       s.num_preemptions)
        yield _counter("pdserve_kv_transfers", "KV buffers sent or received (P/D across "
                       "instances; disagg: hand-offs between its pools).", s.kv_transfers)
        yield _counter("pdserve_kv_transfer_bytes", "Bytes of those KV buffers.",
                       s.kv_transfer_bytes)
        yield from _split_gauges(s)


def _split_gauges(s: EngineStats) -> Iterable[Metric]:
    """The latest batch and SM split. Names mention ``batch`` / ``sms`` so that the benchmark's
    timeline poller picks them up and plots SM counts on their own axis."""
    yield _gauge("pdserve_decode_batch_size", "Decode requests in the latest step "
                 "(multiplex: the decode launch in flight); 0 when idle.", s.last_batch_decode)
    yield _gauge("pdserve_prefill_batch_tokens", "Prompt tokens in the latest step "
                 "(multiplex: the prefill piece in flight); 0 when idle.",
                 s.last_batch_prefill_tokens)
    yield _gauge("pdserve_decode_sms", "SMs of the decode partition (multiplex; 0 otherwise).",
                 s.decode_sms)
    yield _gauge("pdserve_prefill_sms", "SMs of the prefill partition (multiplex; 0 otherwise).",
                 s.prefill_sms)
    mode = GaugeMetricFamily("pdserve_mux_mode", "The latest multiplex split's mode: 1 for "
                             "the current one, 0 for the others ('none': not multiplexing).",
                             labels=["mode"])
    current = s.mux_mode or "none"
    states = (*MUX_MODES, "none")
    for name in states if current in states else (*states, current):
        mode.add_metric([name], 1.0 if name == current else 0.0)
    yield mode


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
