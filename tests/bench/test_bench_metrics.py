"""Metrics against hand-made timestamps: every number here is worked out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.metrics import (
    RequestRecord,
    chunk_token_runs,
    chunk_tokens_of,
    distinct_errors,
    slo_attainment,
    stats_ms,
    summarize,
)


def _record(send: float, chunks: list[tuple[float, int]], end: float,
            prompt_len: int = 10) -> RequestRecord:
    record = RequestRecord(prompt_len, sum(n for _, n in chunks), send)
    for t, n in chunks:
        record.add_chunk(t, n)
    record.end_time = end
    record.success = True
    return record


def test_single_request_ttft_itl_tpot_e2e():
    # Sent at 1.0; tokens at 1.1, 1.15, 1.25, 1.30; stream closed at 1.30.
    r = _record(1.0, [(1.1, 1), (1.15, 1), (1.25, 1), (1.30, 1)], 1.30)
    assert r.ttft == pytest.approx(0.1)
    assert r.itls == pytest.approx([0.05, 0.10, 0.05])
    assert r.e2e == pytest.approx(0.3)
    assert r.tpot == pytest.approx((0.3 - 0.1) / 3)


def test_multi_token_chunk_splits_its_gap():
    # The second chunk carries 4 tokens 0.2 s after the first: four 50 ms gaps.
    r = _record(0.0, [(0.5, 1), (0.7, 4)], 0.7)
    assert r.num_output_tokens == 5
    assert r.itls == pytest.approx([0.05] * 4)
    assert r.tpot == pytest.approx(0.2 / 4)


def test_first_chunk_with_several_tokens_adds_no_itl_sample():
    # Three tokens in the first chunk at 0.5 s, two more 0.2 s later: TTFT 0.5, two 100 ms
    # gaps; the first chunk's extra tokens have no observable gap of their own.
    r = _record(0.0, [(0.5, 3), (0.7, 2)], 0.7)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.1])
    assert r.tpot == pytest.approx(0.2 / 4)


def test_distinct_errors_in_order_with_counts():
    records = [RequestRecord(1, 1, 0.0) for _ in range(9)]
    for i, r in enumerate(records):
        r.error = f"HTTP 40{i % 2}" if i < 7 else f"other {i}"
    records[0].success, records[0].error = True, ""
    assert distinct_errors(records) == [
        {"error": "HTTP 401", "count": 3}, {"error": "HTTP 400", "count": 3},
        {"error": "other 7", "count": 1}, {"error": "other 8", "count": 1}]


def test_usage_count_overrides_streamed_count():
    r = _record(0.0, [(0.1, 1), (0.2, 1)], 0.3)
    r.output_tokens = 3
    assert r.num_output_tokens == 3
    assert r.tpot == pytest.approx((0.3 - 0.1) / 2)


def test_stats_percentiles():
    s = stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["min"] == 1.0 and s["max"] == 100.0
    assert stats_ms([])["p99"] is None


def test_summary_and_slo_attainment():
    fast = _record(0.0, [(0.1, 1), (0.12, 1), (0.14, 1)], 0.14)  # TTFT 100, TPOT 20
    slow_first = _record(0.0, [(0.6, 1), (0.62, 1)], 0.62)  # TTFT 600
    slow_decode = _record(1.0, [(1.1, 1), (1.2, 1), (1.3, 1)], 1.3)  # TPOT 100
    failed = RequestRecord(10, 3, 1.5)
    failed.end_time, failed.error = 1.6, "HTTP 500"
    records = [fast, slow_first, slow_decode, failed]
    summary = summarize(records, duration_s=2.0, ttft_slo_ms=200, itl_slo_ms=50)
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_token_throughput"] == pytest.approx(8 / 2.0)
    assert summary["slo_attainment"] == pytest.approx(0.25)  # failures count as misses
    assert summary["ttft_ms"]["mean"] == pytest.approx((100 + 600 + 100) / 3)
    assert summary["itl_ms"]["max"] == pytest.approx(100)
    assert summary["e2e_ms"]["p50"] == pytest.approx(300)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(summary[key]) >= {"mean", "p50", "p90", "p99"}
    assert slo_attainment(records, 700, None) == pytest.approx(0.75)
    assert slo_attainment(records, None, None) is None


def test_chunk_tokens_are_recorded_as_runs():
    assert chunk_token_runs([1, 1, 1, 2, 1, 0]) == [[1, 3], [2, 1], [1, 1], [0, 1]]
    assert chunk_tokens_of({"chunk_token_runs": [[1, 3], [2, 1]]}) == [1, 1, 1, 2]
    assert chunk_tokens_of({"chunk_tokens": [2, 1]}) == [2, 1]  # a record from before runs
    assert chunk_token_runs([]) == [] and chunk_tokens_of({}) == []


@given(st.lists(st.integers(min_value=0, max_value=4), max_size=60))
def test_chunk_token_runs_keep_every_count(tokens):
    runs = chunk_token_runs(tokens)
    assert chunk_tokens_of({"chunk_token_runs": runs}) == tokens
    assert all(a[0] != b[0] for a, b in zip(runs, runs[1:], strict=False))  # maximal runs
