"""The P/D group simulator on hand-made cases whose answers are known."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.sim.cluster import GroupSim, LatencyModel, SimRequest, summarize

# 1 ms per prompt token, nothing quadratic; decode 10 ms a step; a 1 GB/s link.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=1_000_000,
                     link_gb_per_s=1.0, decode_kv_tokens=100_000)


def _requests() -> list[SimRequest]:
    # One short prompt each to teach both instances their speed, then a long prompt and two
    # short ones: blind placement puts the last one behind the long prompt.
    return [SimRequest(0.0, 1000, 4), SimRequest(0.0, 1000, 4), SimRequest(2.0, 10_000, 4),
            SimRequest(2.1, 1000, 4), SimRequest(2.2, 1000, 4)]


def test_one_request_first_token_after_prefill_then_transfer_and_decode():
    (request,) = GroupSim(MODEL, 1, 1).run([SimRequest(0.0, 500, 5)])
    assert request.first_token == pytest.approx(0.5)  # 500 ms of prefill
    # then 500 MB at 1 GB/s, then 4 more tokens of 10 ms each
    assert request.finished == pytest.approx(0.5 + 0.5 + 4 * 0.01)


@pytest.mark.parametrize("dispatch", ["round-robin", "least-connections"])
def test_blind_dispatch_queues_a_short_prompt_behind_a_long_one(dispatch):
    last = GroupSim(MODEL, 2, 1, dispatch=dispatch, ttft_slo_s=2.0).run(_requests())[-1]
    assert last.first_token - last.arrival > 8.0  # waited for most of the 10 s prompt


def test_on_demand_sends_it_where_it_starts_in_time():
    requests = GroupSim(MODEL, 2, 1, dispatch="on-demand", ttft_slo_s=2.0).run(_requests())
    last = requests[-1]
    assert last.first_token - last.arrival < 2.0
    assert last.offers == 2  # the instance busy with the long prompt refused it first
    # Only the 10 s prompt misses a 2 s SLO here; blind placement loses the last one too.
    assert summarize(requests, 2.0)["slo_attainment"] == pytest.approx(0.8)
    blind = GroupSim(MODEL, 2, 1, dispatch="least-connections").run(_requests())
    assert summarize(blind, 2.0)["slo_attainment"] == pytest.approx(0.6)


def test_requests_nobody_takes_in_time_are_unserved_after_max_wait():
    requests = [SimRequest(0.0, 1000, 2)] + [SimRequest(1.0 + 0.01 * i, 5000, 2)
                                             for i in range(5)]
    sim = GroupSim(MODEL, 1, 1, dispatch="on-demand", ttft_slo_s=1.0, max_wait_s=3.0)
    summary = summarize(sim.run(requests), 1.0)
    assert 0 < summary["served"] < len(requests)
    assert all(r.unserved == (r.first_token is None) for r in requests)


def test_fit_to_measured_engine_results(tmp_path):
    path = tmp_path / "engine.json"
    points = {"prefill": [{"tokens": n, "seconds": 1e-4 * n + 1e-9 * n * n}
                          for n in (1024, 8192, 32768)],
              "decode": [{"batch": b, "context": c, "step_ms": 1e3 * (0.015 + 1e-4 * b
                                                                        + 1e-8 * b * c)}
                         for b in (1, 16, 64) for c in (1024, 8192)],
              "kv_pool_tokens": 123_456}
    path.write_text(__import__("json").dumps({"models": [points]}))
    model = LatencyModel.from_engine_results(str(path), kv_bytes_per_token=100)
    assert model.prefill_s(8192) == pytest.approx(1e-4 * 8192 + 1e-9 * 8192 ** 2, rel=1e-6)
    assert model.decode_step_s(16, 16 * 4096) == pytest.approx(0.015 + 16e-4 + 1e-8 * 16 * 4096,
                                                               rel=1e-6)
    assert model.decode_kv_tokens == 123_456


def test_ratio_controller_moves_decode_instances_to_a_short_prefill_side():
    from pdserve.cluster.config import RatioConfig

    def steady(rate: float, count: int) -> list[SimRequest]:
        return [SimRequest(i / rate, 1000, 4) for i in range(count)]  # 1 s of prefill each

    ratio = RatioConfig(min_requests=10, cooldown_s=5.0)
    static = GroupSim(MODEL, 1, 3, ttft_slo_s=2.0, max_wait_s=10.0)
    dynamic = GroupSim(MODEL, 1, 3, ttft_slo_s=2.0, max_wait_s=10.0, ratio=ratio,
                       ratio_interval_s=2.0)
    static_summary = summarize(static.run(steady(2.0, 200)), 2.0)
    dynamic_summary = summarize(dynamic.run(steady(2.0, 200)), 2.0)
    assert [role for _, _, role in dynamic.moves][:1] == ["prefill"]
    assert len(dynamic.active("prefill")) >= 2 and len(dynamic.active("decode")) >= 1
    assert dynamic_summary["slo_attainment"] > static_summary["slo_attainment"] + 0.3


def test_a_moved_decode_instance_joins_prefill_once_its_last_decode_finishes():
    sim = GroupSim(MODEL, 1, 2)
    settled = []
    sim.loop.at(0.4, lambda: sim._move("prefill"))  # both decode instances are mid-decode
    sim.loop.at(0.45, lambda: settled.append(dict(sim.draining)))
    requests = sim.run([SimRequest(0.0, 100, 50), SimRequest(0.0, 100, 50)])
    assert sim.moves[0][1:] == ("n1", "prefill")
    assert settled == [{"n1": "prefill"}]  # still decoding at 0.45 s: not yet a prefill one
    assert sim.roles["n1"] == "prefill" and not sim.draining  # joined after its decode ended
    assert all(r.finished is not None for r in requests)


# Prefill takes 1 s a request, 2.5 arrive a second: prefill needs 3 instances. A decode
# instance holds 10 requests of 1,500 tokens, 5 s each: 2 a second, so decode needs 2.
SHORT_DECODE = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=1_000_000,
                            link_gb_per_s=1.0, decode_kv_tokens=15_000)


def _balanced_run(num_prefill: int) -> tuple[GroupSim, float]:
    from pdserve.cluster.config import RatioConfig

    sim = GroupSim(SHORT_DECODE, num_prefill, 6 - num_prefill, ttft_slo_s=2.0,
                   max_wait_s=30.0, ratio=RatioConfig())
    requests = sim.run([SimRequest(i / 2.5, 1000, 500) for i in range(400)])
    e2e = sorted(r.finished - r.arrival for r in requests if r.finished is not None)
    return sim, e2e[len(e2e) // 2]


def _fewest_decode(sim: GroupSim, num_decode: int) -> int:
    fewest = num_decode
    for _, _, role in sim.moves:
        num_decode += 1 if role == "decode" else -1
        fewest = min(fewest, num_decode)
    return fewest


def test_ratio_controller_stops_moving_to_prefill_once_it_keeps_up():
    # From 1P5D a backlog builds before prefill has its 3 instances; its requests keep the
    # TTFT share of answered requests high long after. The old judge read that as a
    # shortage and moved on to 5P1D, starving decode (median E2E 16 s against 7 s).
    sim, median_e2e = _balanced_run(1)
    assert [role for _, _, role in sim.moves][:2] == ["prefill", "prefill"]
    assert len(sim.active("prefill")) >= 3
    assert _fewest_decode(sim, 5) >= 2
    assert median_e2e < 10.0


def test_ratio_controller_rescues_a_decode_starved_group():
    sim, median_e2e = _balanced_run(5)  # static 5P1D: median E2E 27 s
    assert sim.moves[0][2] == "decode"
    assert len(sim.active("decode")) >= 2 and len(sim.active("prefill")) >= 3
    assert median_e2e < 10.0


def test_fit_finds_a_fixed_cost_per_prefill_and_never_a_negative_one():
    prefill = [{"tokens": n, "seconds": 0.1 + 1e-4 * n} for n in (64, 256, 1024)]
    # Decode noise that would pull the per-request cost below zero.
    decode = [{"batch": b, "context": 100, "step_ms": ms}
              for b, ms in ((1, 35.0), (4, 34.0), (8, 33.5))]
    model = LatencyModel.fit(prefill, decode, kv_bytes_per_token=1)
    assert model.prefill_s(512) == pytest.approx(0.1 + 1e-4 * 512, rel=1e-6)
    assert model.decode_per_request_s == 0.0 and model.decode_per_kv_token_s >= 0.0
    assert model.decode_step_s(8, 800) > 0.03


def test_multiplexing_instance_slows_each_side_while_the_other_works():
    from pdserve.sim.cluster import Multiplexing

    sim = GroupSim(MODEL, 1, 0, multiplexing=Multiplexing(decode_slowdown=2.0,
                                                          prefill_slowdown=3.0))
    first, second = sim.run([SimRequest(0.0, 100, 11), SimRequest(0.125, 100, 3)])
    assert first.first_token == pytest.approx(0.1)  # nothing decoding beside it
    # Decode starts at 0.1 s, no KV transfer; 3 steps of 10 ms, then the second prompt
    # prefills beside it from 0.125 s: from the next step (0.13 s) steps take 20 ms.
    assert first.finished == pytest.approx(0.13 + 7 * 0.02)
    assert second.first_token == pytest.approx(0.125 + 3 * 0.1)  # a batch decoded beside it
    assert second.finished == pytest.approx(0.425 + 2 * 0.01)


def test_multiplexing_cycle_gives_a_prompt_what_the_decode_step_leaves_of_it():
    from pdserve.sim.cluster import Multiplexing

    mux = Multiplexing(decode_slowdown=2.0, prefill_slowdown=3.0, cycle_s=0.04)
    first, second = GroupSim(MODEL, 1, 0, multiplexing=mux).run(
        [SimRequest(0.0, 100, 11), SimRequest(0.125, 100, 3)])
    # Beside a 10 ms decode step the prompt gets 30 of each 40 ms cycle: 100 ms alone
    # takes 133 ms (not the probe's fixed 3x).
    assert second.first_token == pytest.approx(0.125 + 0.1 * 0.04 / 0.03)
    # Decode: 3 steps of 10 ms to 0.13 s, then 40 ms cycles while the prompt prefills; the
    # boundary after it ends (0.258 s) is 0.29 s (4 cycles), then 10 ms steps for the
    # first request's last 3 and, joined there, the second's 2.
    assert first.finished == pytest.approx(0.13 + 4 * 0.04 + 3 * 0.01)
    assert second.finished == pytest.approx(0.29 + 2 * 0.01)


def test_multiplexing_cycle_and_fixed_factors_by_hand():
    from pdserve.sim.cluster import Multiplexing

    cycle = Multiplexing(2.0, 3.0, cycle_s=0.04)
    assert cycle.prefill_factor(0.01) == pytest.approx(4 / 3)
    assert cycle.decode_stretch(0.01, 1e-3) == (0.04, 0.0)  # stretched to the cycle
    # A step alone of the cycle or longer: the fixed factors, on both sides.
    assert cycle.prefill_factor(0.04) == 3.0
    assert cycle.decode_stretch(0.05, 1e-3) == (0.1, 2e-3)
    assert cycle.covers(0.039) and not cycle.covers(0.04)
    fixed = Multiplexing(2.0, 3.0)
    assert fixed.prefill_factor(0.01) == 3.0
    assert fixed.decode_stretch(0.01, 1e-3) == (0.02, 2e-3)
    assert fixed.covers(10.0)


def test_multiplexing_slowdowns_from_a_multiplex_result(tmp_path):
    from pdserve.sim.cluster import Multiplexing

    run = {"itl_slo_ms": 40.0, "multiplex": {
        "decode_step_ms_alone": {"p50": 20.0}, "decode_step_ms_while_prefilling": {"p50": 30.0},
        "prompt_tokens": 1000, "prefill_tokens_per_s": 500.0}}
    path = tmp_path / "multiplex.json"
    path.write_text(__import__("json").dumps({"runs": [run]}))
    mux = Multiplexing.from_multiplex_results(str(path), MODEL)  # MODEL: 1 s for 1000 tokens
    assert mux == Multiplexing(decode_slowdown=1.5, prefill_slowdown=2.0)
    with pytest.raises(ValueError, match="no P/D ratio"):
        from pdserve.cluster.config import RatioConfig

        GroupSim(MODEL, 1, 1, multiplexing=mux, ratio=RatioConfig())


def test_measured_spread_stretches_prefill_and_decode_times():
    from pdserve.sim.cluster import ServiceNoise

    noise = ServiceNoise(prefill_ratios=[2.0], decode_ratios=[3.0], steps=1 << 12)
    (request,) = GroupSim(MODEL, 1, 1, noise=noise).run([SimRequest(0.0, 500, 5)])
    assert request.first_token == pytest.approx(1.0)  # 500 ms of prefill, twice
    assert request.finished == pytest.approx(1.0 + 0.5 + 4 * 0.03)  # steps of 10 ms, x3


def test_fit_of_points_that_pull_every_coefficient_negative_is_zero_not_a_crash():
    """Decode points at one context make the per-request and per-KV-token columns
    collinear; noisy steps that shrink as the batch grows then pull every coefficient
    below zero (seen on the H200 with one context): the fit keeps none rather than crash."""
    from pdserve.sim.cluster import fit_nonnegative

    a = np.array([[1.0, b, b * 2048.0] for b in (1, 8, 32)])
    assert fit_nonnegative(a, [-0.03, -0.02, -0.01]) == [0.0, 0.0, 0.0]
    fitted = fit_nonnegative(a, [0.020, 0.021, 0.024])
    assert all(c >= 0 for c in fitted)


def test_relative_fit_keeps_one_slow_large_point_from_deciding_the_small_ones():
    """A CPU calibration's decode points (validation_cpu_tiny_2c81cd3_run1.json.gz: batch,
    context per request, step ms), its batch of 4 at 1.3K context timed at 26 ms where
    the rest of its grid said about 12-14: a plain fit put the batch-1 step at half what
    was timed, the relative one within 15% of it."""
    from pdserve.sim.cluster import fit_nonnegative

    points = [{"batch": b, "context": c, "step_ms": ms} for b, c, ms in (
        (1, 127, 4.185), (2, 136, 5.119), (4, 148, 6.392),
        (1, 1089, 5.109), (2, 1177, 7.939), (4, 1290, 25.957))]
    a = np.array([[1.0, p["batch"], p["batch"] * p["context"]] for p in points])
    seconds = [p["step_ms"] / 1e3 for p in points]
    plain = a @ fit_nonnegative(a, seconds) / seconds
    relative = a @ fit_nonnegative(a, seconds, relative=True) / seconds
    assert plain[0] < 0.6 and 0.85 < relative[0] < 1.15  # batch 1, 127 tokens
    assert max(abs(relative[:5] - 1)) < 0.16 < max(abs(plain[:5] - 1))
    model = MODEL.fit_decode(points)  # the model's decode fit is the relative one
    assert model.decode_step_s(1, 127) / 1e-3 == pytest.approx(relative[0] * 4.185)
    # On points a line fits exactly, both fits find it.
    exact = list(a @ np.array([0.5e-3, 1.2e-3, 3e-6]))
    assert fit_nonnegative(a, exact, relative=True) == pytest.approx([0.5e-3, 1.2e-3, 3e-6])
    with pytest.raises(ValueError, match="above 0"):
        fit_nonnegative(a, [0.0, *seconds[1:]], relative=True)


def test_a_model_at_a_host_speed_scales_its_instances_work_and_nothing_else():
    model = dataclasses.replace(MODEL, prefill_base_s=0.01, handoff_base_s=0.002,
                                gateway_hop_s=0.003, decode_per_kv_token_s=1e-6)
    slower = model.at_speed(prefill=1.5, decode=1.2)
    assert slower.prefill_s(300) == pytest.approx(1.5 * model.prefill_s(300))
    assert slower.decode_step_s(4, 4096) == pytest.approx(1.2 * model.decode_step_s(4, 4096))
    assert slower.handoff_s(300) == model.handoff_s(300)
    assert slower.gateway_hop_s == model.gateway_hop_s


def test_handoff_fitted_beyond_the_link_delays_the_join_and_only_that():
    # Measured: 30 ms per handoff plus 20 us per prompt token, the link's 1 ms/token included.
    points = [{"tokens": n, "seconds": 0.03 + 2e-5 * n + 1e-3 * n} for n in (64, 256, 1024)]
    model = MODEL.fit_handoff(points)
    assert model.handoff_base_s == pytest.approx(0.03)
    assert model.handoff_per_token_s == pytest.approx(2e-5)
    assert model.handoff_s(500) == pytest.approx(0.5 + 0.03 + 0.01)
    (request,) = GroupSim(model, 1, 1).run([SimRequest(0.0, 500, 5)])
    assert request.first_token == pytest.approx(0.5)  # the prefill is not slowed
    assert request.finished == pytest.approx(0.5 + 0.54 + 0.04)  # joins later, same steps


def test_decode_ratios_held_for_several_steps_each():
    from pdserve.sim.cluster import ServiceNoise

    # Ratios 1 or 3, each held for 4 steps: every run of 4 steps from the start is uniform.
    noise = ServiceNoise([1.0], [1.0, 3.0], steps=64, first_step=0, steps_per_ratio=4)
    blocks = [noise.span(i, i + 4)[0] for i in range(0, 60, 4)]
    assert set(blocks) <= {4.0, 12.0} and len(set(blocks)) == 2
    assert noise.span(0, 64)[0] == pytest.approx(sum(blocks) + noise.span(60, 64)[0])


def test_handoff_fit_is_never_negative():
    # A handoff quicker than the link's model (a slow link assumed): no negative cost.
    model = MODEL.fit_handoff([{"tokens": n, "seconds": 1e-4 * n} for n in (64, 1024)])
    assert model.handoff_base_s == 0.0 and model.handoff_per_token_s == 0.0
