"""The fleet simulator: decode's jumps against a step-by-step reference, tidal arrivals,
several gateways, groups and one pool over the same instances."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from pdserve.cluster.config import RatioConfig
from pdserve.sim.cluster import DecodeSim, EventLoop, LatencyModel, ServiceNoise, SimRequest
from pdserve.sim.fleet import FleetPlan, FleetSim, Lengths, Scenario, Tally, plan_fleet

MODEL = LatencyModel(1e-4, 1e-9, 0.015, 1e-4, 1e-7, kv_bytes_per_token=1000,
                     link_gb_per_s=1.0, decode_kv_tokens=20_000)
LENGTHS = Lengths(np.array([200, 1000, 3000, 500]), np.array([20, 50, 5, 100]))


def _stepwise_finish_times(model: LatencyModel, arrivals: list[SimRequest],
                           max_batch: int, ratio=lambda step: 1.0) -> list[float]:
    """Reference: continuous batching one step at a time (admit at each step's start, in
    order, while the KV pool has room); step ``n`` of a busy period takes ``ratio(n)``
    times the model's step."""
    pending = sorted(arrivals, key=lambda r: r.arrival)
    waiting, running, now, done, step = [], [], 0.0, {}, 0
    while pending or waiting or running:
        if not running and not waiting and pending[0].arrival > now:  # idle: a new period
            now, step = pending[0].arrival, 0
        while pending and pending[0].arrival <= now:
            waiting.append(pending.pop(0))
        while waiting and len(running) < max_batch and (
                not running or sum(r.input_len + r.output_len for r, _ in running)
                + waiting[0].input_len + waiting[0].output_len <= model.decode_kv_tokens):
            request = waiting.pop(0)
            running.append((request, max(1, request.output_len - 1)))
        context = sum(r.input_len + r.output_len - left for r, left in running)
        now += model.decode_step_s(len(running), context) * ratio(step)
        step += 1
        running = [(r, left - 1) for r, left in running]
        for request, left in running:
            if left == 0:
                done[id(request)] = now
        running = [(r, left) for r, left in running if left > 0]
    return [done[id(r)] for r in arrivals]


def _decode_alone(requests: list[SimRequest], max_batch: int,
                  noise: ServiceNoise | None = None) -> None:
    loop = EventLoop()
    decode = DecodeSim("d", loop, MODEL, max_batch=max_batch)
    decode.noise = noise
    for request in requests:
        loop.at(request.arrival, decode.receive, request)
    loop.run()


def _random_requests(seed: int, gaps_s: float = 5.0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    return [SimRequest(float(t), int(i), int(o)) for t, i, o in
            zip(np.sort(rng.uniform(0, gaps_s, 60)), rng.integers(100, 4000, 60),
                rng.integers(1, 120, 60), strict=True)]


@pytest.mark.parametrize("max_batch", [4, 256])
def test_decode_jumps_land_where_stepping_one_step_at_a_time_does(max_batch):
    requests = _random_requests(3)
    _decode_alone(requests, max_batch)
    expected = _stepwise_finish_times(MODEL, requests, max_batch)
    assert [r.finished for r in requests] == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("max_batch", [4, 256])
def test_noisy_decode_jumps_match_noisy_steps(max_batch):
    """Measured step ratios (one in ten steps a 4x stall): the jumps still land where a
    step-by-step run with the same ratio per step does, busy periods included."""
    # Every busy period at the same place: the reference's.
    noise = ServiceNoise([1.0], [1.0] * 9 + [4.0], seed=5, steps=1 << 16, first_step=7)
    requests = _random_requests(4, gaps_s=30.0)  # idle gaps: several busy periods
    _decode_alone(requests, max_batch, noise)
    ratios = np.diff(noise._sum)
    expected = _stepwise_finish_times(MODEL, requests, max_batch, lambda n: ratios[7 + n])
    assert [r.finished for r in requests] == pytest.approx(expected, rel=1e-9, abs=1e-9)
    plain = _random_requests(4, gaps_s=30.0)
    _decode_alone(plain, max_batch)
    assert sum(r.finished for r in requests) > sum(r.finished for r in plain)


def test_a_scenario_gets_more_requests_at_its_peak_than_in_its_trough():
    # a peaks at 0 s, b at 50 s, in a 100 s period whose trough is a tenth of the peak.
    scenarios = [Scenario("a", 2, 2, 20.0, 0.0, 0.2, 1.0),
                 Scenario("b", 2, 2, 20.0, 50.0, 0.2, 1.0)]
    fleet = FleetSim(FleetPlan(scenarios, period_s=100.0, trough=0.1), MODEL, LENGTHS)
    halves = {}
    for scenario in scenarios:
        t = fleet._poisson(scenario, 0.0, 100.0)
        around_zero = int(((t < 25) | (t >= 75)).sum())
        halves[scenario.name] = (around_zero, len(t) - around_zero)
    assert halves["a"][0] > 2 * halves["a"][1] and halves["b"][1] > 2 * halves["b"][0]
    summary = fleet.run(100.0)
    assert sum(n for _, n, _ in summary["by_minute"]) == summary["requests"] > 0


@pytest.mark.parametrize("pooled", [False, True])
def test_every_request_is_answered_or_given_up_and_gateways_end_with_nothing_in_flight(pooled):
    plan = plan_fleet(MODEL, LENGTHS, num_instances=60, num_scenarios=6, period_s=60.0)
    assert sum(s.num_prefill + s.num_decode for s in plan.scenarios) == 60
    fleet = FleetSim(plan, MODEL, LENGTHS, num_gateways=3, ratio=RatioConfig(), pooled=pooled)
    summary = fleet.run(60.0)
    assert summary["requests"] > 1000
    assert 0.5 < summary["slo_attainment"] <= 1.0
    for gateway in fleet.gateways:
        assert not any(gateway.load.values()) and not any(gateway.decode_load.values())
    assert all(g.turn > 0 for g in fleet.gateways)  # requests spread over every gateway


def test_one_pool_has_the_instances_of_all_groups():
    plan = plan_fleet(MODEL, LENGTHS, num_instances=40, num_scenarios=4)
    pool = FleetSim(plan, MODEL, LENGTHS, pooled=True)
    groups = FleetSim(plan, MODEL, LENGTHS)
    assert len({id(g) for g in pool.groups}) == 1
    assert len(pool.groups[0].prefill) == sum(len(g.prefill) for g in groups.groups) == 40


def test_a_fleet_wide_split_changes_the_roles_not_the_traffic():
    ideal = plan_fleet(MODEL, LENGTHS, num_instances=200, num_scenarios=5)
    fixed = plan_fleet(MODEL, LENGTHS, num_instances=200, num_scenarios=5, prefill_share=0.3)
    assert [s.peak_rate for s in fixed.scenarios] == [s.peak_rate for s in ideal.scenarios]
    assert [s.num_prefill + s.num_decode for s in fixed.scenarios] == \
        [s.num_prefill + s.num_decode for s in ideal.scenarios]
    assert [s.num_prefill for s in fixed.scenarios] == \
        [round(0.3 * (s.num_prefill + s.num_decode)) for s in fixed.scenarios]
    assert [s.num_prefill for s in fixed.scenarios] != [s.num_prefill for s in ideal.scenarios]


@pytest.mark.parametrize("dispatch", ["on-demand", "least-connections", "round-robin"])
def test_kept_offer_orders_match_the_gateways_sort_on_every_request(dispatch):
    """The simulator keeps each gateway's offer order as loads change instead of calling
    ``order_prefill`` per request; checked against it on every request, through role moves
    and several gateways."""
    plan = plan_fleet(MODEL, LENGTHS, num_instances=60, num_scenarios=4, period_s=60.0,
                      peak_load=1.2)
    fleet = FleetSim(plan, MODEL, LENGTHS, dispatch=dispatch, num_gateways=3,
                     ratio=RatioConfig(min_requests=5, cooldown_s=5.0))
    for group in fleet.groups:
        group.verify_order = True
    summary = fleet.run(60.0)
    assert summary["requests"] > 1000
    assert sum(len(g.moves) for g in fleet.groups) > 0  # orders rebuilt after moves too


def test_a_run_leaves_no_reference_cycles_for_the_paused_collector():
    """The event loop pauses Python's cycle collector: that is only safe while reference
    counting alone frees every request, event and batch of a run."""
    plan = plan_fleet(MODEL, LENGTHS, num_instances=60, num_scenarios=6, period_s=60.0)
    FleetSim(plan, MODEL, LENGTHS, num_gateways=3, ratio=RatioConfig()).run(10.0)  # warm-up
    fleet = FleetSim(plan, MODEL, LENGTHS, num_gateways=3, ratio=RatioConfig())
    gc.collect()
    summary = fleet.run(60.0)
    assert summary["requests"] > 1000 and gc.isenabled()
    assert gc.collect() == 0  # nothing unreachable was left for the collector


def test_the_loop_runs_its_feed_and_its_heap_in_time_order():
    loop, seen = EventLoop(), []
    feed = iter([0.5, 1.5, 2.5])

    def arrive() -> float:
        seen.append(("feed", loop.now))
        return next(feed, math.inf)

    def again_now() -> None:  # one more action due at the time now running
        seen.append(("heap", loop.now))
        loop.at(loop.now, lambda: seen.append(("again", loop.now)))

    for when in (0.0, 1.0, 3.0):
        loop.at(when, lambda: seen.append(("heap", loop.now)))
    loop.at(1.5, again_now)
    loop.at(1.5, lambda: seen.append(("second", loop.now)))
    loop.feed(next(feed), arrive)
    loop.run()
    assert seen == [("heap", 0.0), ("feed", 0.5), ("heap", 1.0), ("heap", 1.5),
                    ("second", 1.5), ("again", 1.5), ("feed", 1.5), ("feed", 2.5),
                    ("heap", 3.0)]


def _ended(scenario: int, arrival: float, ttft: float | None, e2e: float = 0.0,
           output_len: int = 1) -> SimRequest:
    """A request that ended: answered (``ttft``) or given up on (None)."""
    request = SimRequest(arrival, 100, output_len, scenario=scenario)
    if ttft is None:
        request.unserved = True
    else:
        request.prefill_done = request.first_token = arrival + ttft
        request.finished = arrival + e2e
    return request


def test_the_tally_counts_ended_requests_together_as_one_at_a_time_would():
    """Counted in batches (``Tally.count``), every figure is what a count per request gives:
    per scenario and minute, within the SLO or not, given up on, TPOT only past one token."""
    tally = Tally(num_scenarios=3, slo_s=2.0)
    first = [_ended(0, 1.0, 0.5, 3.0, output_len=11), _ended(1, 59.5, 2.5, 4.0, output_len=2),
             _ended(2, 30.0, None)]
    second = [_ended(0, 61.0, 2.0, 2.0), _ended(0, 125.0, 1.0, 1.5, output_len=3)]
    for batch in (first, second):
        tally.ended.extend(batch)
        tally.count()
        assert tally.ended == []
    summary = tally.summary()
    assert tally.requests.tolist() == [3, 1, 1] and tally.met.tolist() == [3, 0, 0]
    assert tally.unserved.tolist() == [0, 0, 1] and summary["unserved"] == 1
    assert summary["requests"] == 5 and summary["slo_attainment"] == 3 / 5
    assert summary["worst_scenario_attainment"] == 0.0  # scenarios 1 and 2 met none
    assert summary["by_minute"] == [[0, 3, 1], [1, 1, 1], [2, 1, 1]]
    ttft = np.array([0.5, 2.5, 2.0, 1.0], np.float32)
    assert summary["ttft_p50_s"] == float(np.percentile(ttft, 50))
    tpot = np.array([2.5 / 10, 1.5 / 1, 0.5 / 2], np.float32)  # (e2e - ttft) / (tokens - 1)
    assert summary["tpot_p99_s"] == float(np.percentile(tpot, 99))
