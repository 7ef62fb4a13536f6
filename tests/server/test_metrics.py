"""The server's metrics: the bulk histogram and the gauges on their own, then the vLLM-named
series and the gauges' exactness through a real server."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

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
    metrics = ServerMetrics(lambda: snapshot, lambda: 1, "tiny")
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


def test_with_no_request_in_the_server_nothing_is_running_whatever_the_snapshot():
    snapshot = EngineStats(num_running=2, num_waiting=1, last_batch_decode=2,
                           last_batch_prefill_tokens=6)
    in_flight = [3]
    metrics = ServerMetrics(lambda: snapshot, lambda: in_flight[0], "tiny")
    found = parse_prometheus(metrics.render().decode(), pattern="requests|batch")
    assert found["pdserve_num_requests_running"] == 2
    assert found["pdserve_num_requests_waiting"] == 1
    assert found['vllm:num_requests_running{model_name="tiny"}'] == 2
    in_flight[0] = 0  # the server ended them (stop string) before the engine saw the abort
    found = parse_prometheus(metrics.render().decode(), pattern="requests|batch")
    assert found["pdserve_num_requests_running"] == found["pdserve_num_requests_waiting"] == 0
    assert found["pdserve_decode_batch_size"] == found["pdserve_prefill_batch_tokens"] == 0


VLLM_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
               "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
               "vllm:inter_token_latency_seconds_count",
               "vllm:time_per_output_token_seconds_count",
               "vllm:e2e_request_latency_seconds_count", "vllm:num_preemptions_total",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def _by_name(values: dict[str, float]) -> dict[str, float]:
    """Series without their labels (each of these has one label set here)."""
    return {key.split("{")[0]: value for key, value in values.items()}


def _assert_idle(m: dict[str, float]) -> None:
    for name in ("pdserve_num_requests_running", "pdserve_num_requests_waiting",
                 "pdserve_decode_batch_size", "pdserve_prefill_batch_tokens",
                 "pdserve_kv_cache_usage_ratio", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert m[name] == 0, (name, m[name])


def test_gauges_are_exact_the_moment_a_request_ends(server):
    client = server.openai()
    before = _by_name(server.metrics())
    out = client.completions.create(model="tiny", prompt="Count", max_tokens=24,
                                    extra_body={"ignore_eos": True})
    after = _by_name(server.metrics())  # no wait: the snapshot came ahead of the last token
    _assert_idle(after)
    for name in VLLM_SERIES:
        assert name in after, name
    grown = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert grown == out.usage.completion_tokens == 24
    assert after["vllm:e2e_request_latency_seconds_count"] == \
        before.get("vllm:e2e_request_latency_seconds_count", 0) + 1
    assert after["vllm:prompt_tokens_total"] == after["pdserve_prompt_tokens_total"]


def test_gauges_are_exact_when_a_stop_string_ends_the_stream(server):
    client = server.openai()
    kwargs = dict(model="tiny", prompt="abc", temperature=0, max_tokens=48,
                  extra_body={"ignore_eos": True})
    visible = client.completions.create(**kwargs).choices[0].text.replace("\ufffd", "")
    if len(visible) < 8:
        pytest.skip("the dummy model produced too little printable text to cut")
    stop = visible[4:6]  # early: the engine is still generating when the stream ends
    chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "stop"
    _assert_idle_but_kv(_by_name(server.metrics()))


def _assert_idle_but_kv(m: dict[str, float]) -> None:
    # The engine frees the aborted request's pages when it reads the abort, a moment later.
    for name in ("pdserve_num_requests_running", "pdserve_num_requests_waiting",
                 "pdserve_decode_batch_size", "pdserve_prefill_batch_tokens",
                 "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert m[name] == 0, (name, m[name])


def test_the_grafana_dashboard_reads_only_series_the_server_serves(server):
    dashboard = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdserve.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"]
             for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\b(?:vllm:|pdserve_)[a-z0-9_:]+", e)}
    server.openai().completions.create(model="tiny", prompt="x", max_tokens=2)  # labelled
    served = {key.split("{")[0] for key in server.metrics()}
    assert used and used <= served, used - served
