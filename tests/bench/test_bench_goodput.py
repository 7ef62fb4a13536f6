"""Goodput search: exact on a synthetic curve, and the knee of a stand-in server over HTTP."""

from __future__ import annotations

import asyncio

import pytest
from bench_standin import StandIn, ThreadedServer

from pdserve.bench.client import HttpBackend
from pdserve.bench.goodput import goodput_from_curve, search_goodput, sweep_goodput
from pdserve.bench.runner import GoodputOptions, RunContext, SloOptions, run_workload
from pdserve.bench.spec import WorkloadSpec


def _step_curve(knee: float):
    async def measure(rate: float) -> tuple[float, dict]:
        return (0.99 if rate <= knee else 0.5), {}
    return measure


def test_bisection_brackets_the_knee():
    result = asyncio.run(search_goodput(_step_curve(7.3), start_rate=1.0, rel_tol=0.05))
    assert 7.3 * 0.95 <= result.goodput_rps <= 7.3
    assert [p["rate"] for p in result.points][:4] == [1.0, 2.0, 4.0, 8.0]


def test_bisection_from_above_and_unreachable():
    low = asyncio.run(search_goodput(_step_curve(0.7), start_rate=4.0, rel_tol=0.05))
    assert 0.7 * 0.95 <= low.goodput_rps <= 0.7
    top = asyncio.run(search_goodput(_step_curve(1e9), start_rate=1.0, max_rate=16.0))
    assert top.goodput_rps == 16.0


def test_sweep_ignores_a_lucky_pass_above_a_failure():
    assert goodput_from_curve([(1, 0.95), (2, 0.92), (4, 0.8), (8, 0.91)], 0.9) == 2
    result = asyncio.run(sweep_goodput(_step_curve(3.0), [1, 2, 4, 8]))
    assert result.goodput_rps == 2


def test_goodput_finds_standin_knee():
    # Prefill serialised at 50 ms/request: 20 req/s capacity. With near-constant arrivals and
    # 100 ms of TTFT slack, 90% of 20 requests meet the SLO up to about 22.7 req/s.
    spec = WorkloadSpec(num_prompts=20, input_len=8, output_len=3, burstiness=100.0, seed=1)
    slo = SloOptions(ttft_slo_ms=150.0, itl_slo_ms=50.0)
    opts = GoodputOptions(enabled=True, start_rate=10.0, rel_tol=0.1, max_probes=8)
    with ThreadedServer(StandIn(prefill_ms=50.0, itl_ms=5.0)) as server:
        result = asyncio.run(_run(server.url, spec, slo, opts))
    print("standin goodput", result["goodput_rps"])
    assert 15.0 <= result["goodput_rps"] <= 26.0, result["goodput"]["points"]
    points = sorted((p["rate"], p["attainment"]) for p in result["goodput"]["points"])
    # Started at 10 req/s (at 5, the first probe alone took 4 s) and went past the knee:
    # the highest probe failed (which side of 20 req/s the knee falls on depends on the
    # host's load: client and stand-in share one process, so the search need not reach 25).
    assert points[0][0] == 10.0 and points[-1][1] < 0.9
    assert any(met >= 0.9 for rate, met in points if rate >= 15.0)
    assert result["slo_attainment"] >= 0.9


async def _run(url, spec, slo, opts, warmup=0):
    backend = HttpBackend(url)
    await backend.start()
    try:
        ctx = RunContext(progress=False, warmup_requests=warmup)
        return await run_workload(backend, spec, slo, opts, ctx)
    finally:
        await backend.close()


@pytest.mark.parametrize("rate", [5.0])
def test_standin_run_metrics(rate):
    spec = WorkloadSpec(num_prompts=6, input_len=8, output_len=4, request_rate=rate, seed=2)
    slo = SloOptions(ttft_slo_ms=1000.0, itl_slo_ms=100.0)
    standin = StandIn(prefill_ms=20.0, itl_ms=10.0)
    with ThreadedServer(standin) as server:
        result = asyncio.run(_run(server.url, spec, slo, GoodputOptions(), warmup=2))
    assert result["completed"] == 6 and result["slo_attainment"] == 1.0
    # Warm-up: two unmeasured requests, same lengths, other tokens (no prefix-cache hits).
    warm, measured = standin.requests[:2], standin.requests[2:]
    assert len(measured) == 6 and all(w["max_tokens"] == 4 for w in warm)
    assert [len(w["prompt"]) for w in warm] == [len(m["prompt"]) for m in measured[:2]]
    assert all(w["prompt"] != m["prompt"] for w in warm for m in measured)
    assert 20.0 <= result["ttft_ms"]["p50"] < 200.0
    assert 9.0 <= result["itl_ms"]["p50"] < 60.0
    assert len(result["samples"]) == 6 and all(len(s["itl_ms"]) == 3 for s in result["samples"])
    sent = measured[0]
    assert sent["ignore_eos"] and sent["stream"] and sent["max_tokens"] == 4
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert len(sent["prompt"]) == 8


# --- the search carried across sessions: state from the curve alone -------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdserve.bench.goodput import Bracket, next_rate, rate_bracket  # noqa: E402

_ladders = st.lists(st.integers(1, 400), min_size=1, max_size=16, unique=True).map(
    lambda xs: sorted(x / 20 for x in xs))


@given(ladder=_ladders, knee=st.floats(0.0, 25.0), start_index=st.integers(0, 15))
def test_ladder_search_ends_at_the_highest_rung_under_the_knee(ladder, knee, start_index):
    start = ladder[start_index % len(ladder)]
    curve: list[tuple[float, float]] = []
    while (rate := next_rate(curve, ladder, start)) is not None:
        assert rate in ladder and rate not in [r for r, _ in curve]  # never probes twice
        curve.append((rate, 0.95 if rate <= knee else 0.4))
    passing = [r for r in ladder if r <= knee]
    bracket = rate_bracket(curve)
    assert bracket.low == (max(passing) if passing else 0.0)
    # Settled: nothing on the ladder lies between the last pass and the first failure.
    if bracket.high is not None:
        assert not [r for r in ladder if bracket.low < r < bracket.high]
    else:
        assert bracket.low == ladder[-1]


def test_bracket_descriptions():
    ladder = [0.1, 0.2, 0.3, 0.4]
    assert rate_bracket([(0.2, 0.95), (0.4, 0.5)]).describe(ladder) == "between 0.2 and 0.4"
    assert rate_bracket([(0.2, 0.95), (0.3, 0.5)]).describe(ladder) == "0.2"
    assert rate_bracket([(0.2, 0.95)]).describe(ladder) == ">= 0.2"
    assert rate_bracket([(0.2, 0.5)]).describe(ladder) == "< 0.2"
    assert Bracket(0.0, None).describe() == "not probed"
    # A pass above a failure is noise: the bracket ends at the first failure.
    assert rate_bracket([(0.1, 0.95), (0.2, 0.5), (0.3, 0.95)]) == Bracket(0.1, 0.2)
