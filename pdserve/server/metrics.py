"""Prometheus metrics of the server: request latencies observed here, engine counters read
from the latest stats snapshot the engine process sent.

Each server owns its registry (not the library's global one) so several servers, or tests,
can live in one process. The series vLLM serves are offered too, under vLLM's names with a
``model_name`` label (``VLLM_NAMES``), so dashboards made for vLLM work unchanged.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from pdserve.messages import MUX_MODES, EngineStats, HistogramCounts, RequestMetrics

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
    """``/metrics`` of one HTTP process. Request histograms and counters are kept as plain
    counts (``RequestMetrics``): in this process (``publish`` None: the only HTTP process),
    or, with several HTTP processes, sent to the engine process as each request finishes
    (``publish``) and read back summed over all of them for each scrape (``shown``)."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int],
                 model_name: str, publish: Callable[[RequestMetrics], None] | None = None
                 ) -> None:
        """``in_flight``: requests the server still has with the engine (its own book)."""
        self.publish = publish
        self.local = self.empty()
        self.shown = self.local
        """What the next ``render`` shows (``show`` sets the whole server's sums)."""
        self.others_in_flight = 0
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = BulkHistogram("pdserve_time_to_first_token_seconds",
                                  "Server arrival to the engine's first token.",
                                  _TTFT_BUCKETS, lambda: self.shown.ttft)
        self.itl = BulkHistogram("pdserve_inter_token_latency_seconds",
                                 "Engine-side gap between two consecutive tokens of a request.",
                                 _ITL_BUCKETS, lambda: self.shown.itl)
        self.e2e = BulkHistogram("pdserve_e2e_request_latency_seconds",
                                 "Server arrival to the request's last byte.",
                                 _E2E_BUCKETS, lambda: self.shown.e2e)
        self.finished = _LabelledCounter("pdserve_requests_finished", "Finished requests.",
                                         "finish_reason", lambda: self.shown.finished)
        errors = _LabelledCounter("pdserve_request_errors", "Requests answered with an error.",
                                  "status", lambda: self.shown.errors)
        engine = _EngineCollector(stats, lambda: in_flight() + self.others_in_flight)
        for collector in (self.ttft, self.itl, self.e2e, self.finished, errors, engine):
            r.register(collector)
        r.register(_VLLMNames([self.ttft, self.itl, self.e2e, self.finished, engine],
                              model_name))

    def empty(self) -> RequestMetrics:
        return RequestMetrics(*(HistogramCounts([0] * (len(h) + 1)) for h in
                                (_TTFT_BUCKETS, _ITL_BUCKETS, _E2E_BUCKETS)))

    def observe(self, timing: RequestTiming) -> None:
        into = self.local if self.publish is None else self.empty()
        if timing.first_token is not None:
            self.ttft.observe_many([max(0.0, timing.first_token - timing.arrival)], into.ttft)
        times = timing.token_times
        self.itl.observe_many([b - a for a, b in zip(times, times[1:], strict=False)],
                              into.itl)
        if timing.finished is not None:
            self.e2e.observe_many([timing.finished - timing.arrival], into.e2e)
        _count(into.finished, timing.finish_reason or "abort")
        self._published(into)

    def count_error(self, status: int) -> None:
        into = self.local if self.publish is None else self.empty()
        _count(into.errors, str(status))
        self._published(into)

    def _published(self, delta: RequestMetrics) -> None:
        if self.publish is not None:
            self.publish(delta)

    def show(self, whole_server: RequestMetrics, others_in_flight: int) -> None:
        """The sums over every HTTP process, and the requests the others hold, for the next
        ``render``."""
        self.shown = whole_server
        self.others_in_flight = others_in_flight

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


class BulkHistogram:
    """A histogram fed many values at once. prometheus_client's ``observe`` takes a lock and
    scans the buckets for each value (about 1.5 us); a finished request brings one value per
    token, and requests of a closed-loop load finish in bursts on the event loop. It shows
    the counts ``read`` returns (its own by default)."""

    def __init__(self, name: str, doc: str, buckets: Iterable[float],
                 read: Callable[[], HistogramCounts] | None = None) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in buckets)
        self.own = HistogramCounts([0] * (len(self.bounds) + 1))  # the last one is +Inf
        self._read = read or (lambda: self.own)

    @property
    def sum(self) -> float:
        return self.own.total

    def observe_many(self, values: list[float], into: HistogramCounts | None = None) -> None:
        target = self.own if into is None else into
        counts, bounds = target.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # buckets are "less than or equal"
        target.total += sum(values)

    def collect(self) -> Iterable[Metric]:
        shown = self._read()
        # The engine's sums have no buckets until the first request's figures arrive.
        counts = shown.counts or [0] * (len(self.bounds) + 1)
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=shown.total)


class _LabelledCounter:
    """A counter with one label, read from a ``{label value: count}`` dict."""

    def __init__(self, name: str, doc: str, label: str,
                 read: Callable[[], dict[str, int]]) -> None:
        self._name, self._doc, self._label, self._read = name, doc, label, read

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


class _EngineCollector:
    """Reads the engine's counters at scrape time from the last snapshot."""

    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]) -> None:
        self._stats = stats
        self._in_flight = in_flight

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        # The engine sends a snapshot whenever a request finishes, ahead of its last tokens;
        # capping by the server's own book also drops a request the server has ended (stop
        # string, client gone) before the engine has seen its abort.
        live = self._in_flight()
        running = min(s.num_running, live)
        yield _gauge("pdserve_num_requests_running", "Requests in the running batch.", running)
        yield _gauge("pdserve_num_requests_waiting", "Requests waiting to be scheduled.",
                     min(s.num_waiting, live - running))
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
        yield _kv_sent_by_transport(s)
        yield from _split_gauges(s, idle=live == 0)


def _kv_sent_by_transport(s: EngineStats) -> Metric:
    sent = CounterMetricFamily("pdserve_kv_sent_by_transport", "KV buffers sent to other "
                               "instances, by the transport agreed with each receiver "
                               "(--kv-transport).", labels=["transport"])
    for key, value in sorted(s.extra.items()):
        if key.startswith("kv_sent/"):
            sent.add_metric([key.removeprefix("kv_sent/")], value)
    return sent


def _split_gauges(s: EngineStats, idle: bool = False) -> Iterable[Metric]:
    """The latest batch and SM split. Names mention ``batch`` / ``sms`` so that the benchmark's
    timeline poller picks them up and plots SM counts on their own axis. ``idle``: the
    server holds no request, so no batch is current whatever the last snapshot said."""
    yield _gauge("pdserve_decode_batch_size", "Decode requests in the latest step "
                 "(multiplex: the decode launch in flight); 0 when idle.",
                 0 if idle else s.last_batch_decode)
    yield _gauge("pdserve_prefill_batch_tokens", "Prompt tokens in the latest step "
                 "(multiplex: the prefill piece in flight); 0 when idle.",
                 0 if idle else s.last_batch_prefill_tokens)
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


VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pdserve_num_requests_running": ("vllm:num_requests_running",),
    "pdserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "pdserve_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc",),
    "pdserve_prompt_tokens": ("vllm:prompt_tokens",),
    "pdserve_generation_tokens": ("vllm:generation_tokens",),
    "pdserve_num_preemptions": ("vllm:num_preemptions",),
    "pdserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pdserve_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pdserve_requests_finished": ("vllm:request_success",),
    "pdserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # Gaps between a request's tokens: vLLM's newer name, and the older one dashboards use.
    "pdserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                            "vllm:time_per_output_token_seconds"),
    "pdserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
}
"""pdserve series -> the vLLM series that carry the same values (counters get ``_total``)."""

_VLLM_LABELS = {"finish_reason": "finished_reason"}


class _VLLMNames:
    """The series of ``VLLM_NAMES`` again under vLLM's names, with a ``model_name`` label."""

    def __init__(self, sources: list, model_name: str) -> None:
        self._sources = sources
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        for source in self._sources:
            for family in source.collect():
                for name in VLLM_NAMES.get(family.name, ()):
                    yield self._renamed(family, name)

    def _renamed(self, family: Metric, name: str) -> Metric:
        metric = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # prometheus_client's own; vLLM's dashboards never read it
            labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
            metric.add_sample(name + sample.name[len(family.name):],
                              {"model_name": self._model_name, **labels}, sample.value)
        return metric
