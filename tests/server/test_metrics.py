"""The server's metrics without a server: the bulk histogram and the SM split gauges."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.bench.timeline import parse_prometheus
from pdserve.messages import EngineStats
from pdserve.server.metrics import _ITL_BUCKETS, BulkHistogram, ServerMetrics


def test_bulk_histogram_renders_as_prometheus_histogram():
    rng = random.Random(0)
    values = [rng.choice(_ITL_BUCKETS) if rng.random() < 0.3 else rng.expovariate(40)
              for _ in range(3000)]
    reference = CollectorRegistry()
    histogram = Histogram("gap_seconds", "doc", buckets=_ITL_BUCKETS, registry=reference)
    for value in values:
        histogram.observe(value)
    bulk = BulkHistogram("gap_seconds", "doc", _ITL_BUCKETS)
    registry = CollectorRegistry()
    registry.register(bulk)
    bulk.observe_many(values[:1000])
    bulk.observe_many(values[1000:])
    assert _lines(registry) == _lines(reference)
    assert bulk.sum == pytest.approx(sum(values))


def _lines(registry: CollectorRegistry) -> list[str]:
    # Only prometheus_client's own has ``_created``; sums differ in their last bits (another
    # order of additions).
    return [line for line in generate_latest(registry).decode().splitlines()
            if "gap_seconds_created" not in line and not line.startswith("gap_seconds_sum")]


def test_split_gauges_follow_the_snapshot():
    snapshot = EngineStats(last_batch_decode=12, last_batch_prefill_tokens=384,
                             mux_mode="spatial", decode_sms=48, prefill_sms=84)
    metrics = ServerMetrics(lambda: snapshot)
    found = parse_prometheus(metrics.render().decode(), pattern="batch|sms|mux_mode")
    assert found["pdserve_decode_batch_size"] == 12
    assert found["pdserve_prefill_batch_tokens"] == 384
    assert (found["pdserve_decode_sms"], found["pdserve_prefill_sms"]) == (48, 84)
    assert found['pdserve_mux_mode{mode="spatial"}'] == 1
    assert found['pdserve_mux_mode{mode="none"}'] == 0
    snapshot.mux_mode = "future_mode"  # a mode this server does not know yet still shows
    found = parse_prometheus(metrics.render().decode(), pattern="mux_mode")
    assert found['pdserve_mux_mode{mode="future_mode"}'] == 1
    assert sum(found.values()) == 1
