"""TTFT pressure (``MuxPlannerConfig.ttft_pressed_margin``): while a waiting prompt is
predicted to miss its TTFT SLO at the prefill rate of mixed steps planned to the safety
margin, mixed steps and time slices are planned to the pressed share of the ITL SLO
instead; off by default.

Planned with the latency model of the committed d698fcb H200 profile (codellama-34b) at an
ITL target of 60 ms (a 54 ms budget) beside 150 decoding requests of ~600 tokens, the
ShareGPT-like load at 16 req/s where the planner's 54 ms steps fell behind the arrivals."""

from __future__ import annotations

import pytest

from pdserve.config import SchedulerConfig
from pdserve.sched.mux_planner import (
    DecodeLoad,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)

SPLITS = [(16, 116), (24, 108), (32, 100), (48, 84), (64, 68)]
DECODE = DecodeLoad(150, 150 * 600)
# Ten short prompts that have waited 1.5-1.7 s of a 2 s TTFT SLO: 3,300 tokens at the
# unpressed ~4.9K tokens/s take 0.67 s, so the last ones miss (1.8 s with the margin).
BEHIND = [PrefillRequest(330, 0, waited_ms=1700.0 - 20.0 * i) for i in range(10)]
# One fresh prompt: met at any rate.
ON_TIME = [PrefillRequest(330, 0, waited_ms=10.0)]


def planner_with(profile, margin: float, ttft_slo_ms: float | None = 2000.0, **options
                 ) -> MuxPlanner:
    config = MuxPlannerConfig(itl_slo_ms=60.0, ttft_slo_ms=ttft_slo_ms,
                              ttft_pressed_margin=margin,
                              **{"spatial": False, "time_slice": False, **options})
    return MuxPlanner(OnlineCalibration(profile), SPLITS, config)


def test_a_queue_behind_its_ttft_gets_mixed_steps_to_the_pressed_margin(profile_d698fcb):
    budget = planner_with(profile_d698fcb, 0.0).plan(DECODE, BEHIND)
    pressed = planner_with(profile_d698fcb, 1.0).plan(DECODE, BEHIND)
    assert budget.mode == pressed.mode == MuxMode.TEMPORAL
    assert budget.cycle_ms <= 54.0 < pressed.cycle_ms <= 60.0
    assert pressed.prefill.num_tokens > budget.prefill.num_tokens
    assert pressed.prefill_tokens_per_s > budget.prefill_tokens_per_s
    assert "TTFT pressed" in pressed.reason


def test_a_margin_past_one_plans_steps_past_the_itl_target(profile_d698fcb):
    at_target = planner_with(profile_d698fcb, 1.0).plan(DECODE, BEHIND)
    past = planner_with(profile_d698fcb, 1.1).plan(DECODE, BEHIND)
    assert past.mode == MuxMode.TEMPORAL
    assert 60.0 < past.cycle_ms <= 66.0
    assert past.prefill.num_tokens > at_target.prefill.num_tokens
    assert "TTFT pressed" in past.reason


def test_a_queue_on_time_keeps_the_safety_margin(profile_d698fcb):
    planner = planner_with(profile_d698fcb, 1.0)
    assert not planner.ttft_pressed(DECODE, ON_TIME)
    assert planner.plan(DECODE, ON_TIME) == planner_with(profile_d698fcb, 0.0).plan(
        DECODE, ON_TIME)


def test_pressure_is_the_queue_ahead_over_the_unpressed_rate(profile_d698fcb):
    planner = planner_with(profile_d698fcb, 1.0)
    assert planner.ttft_pressed(DECODE, BEHIND)
    # The same prompts with no wait behind them: 0.67 s, within the 1.8 s the margin
    # leaves of 2 s.
    fresh = [PrefillRequest(330, 0, waited_ms=0.0) for _ in range(10)]
    assert not planner.ttft_pressed(DECODE, fresh)
    # Without a TTFT SLO nothing is pressed.
    assert not planner_with(profile_d698fcb, 1.0, ttft_slo_ms=None).ttft_pressed(
        DECODE, BEHIND)


def test_a_time_slice_takes_the_pressed_room_too(profile_d698fcb):
    options = {"temporal": False, "time_slice": True}
    small = DecodeLoad(8, 8 * 4000)
    queue = [PrefillRequest(4000, 0, waited_ms=1900.0)]
    budget = planner_with(profile_d698fcb, 0.0, **options).plan(small, queue)
    pressed = planner_with(profile_d698fcb, 1.0, **options).plan(small, queue)
    assert budget.mode == pressed.mode == MuxMode.TIME_SLICE
    assert budget.cycle_ms <= 54.0 < pressed.cycle_ms <= 60.0


@pytest.mark.parametrize("fields, match", [
    ({"mux_ttft_pressed_margin": 1.0}, "--ttft-slo-ms"),
    ({"mux_ttft_pressed_margin": 1.6, "ttft_slo_ms": 2000.0}, r"\[--mux-itl-margin"),
    ({"mux_ttft_pressed_margin": 0.8, "ttft_slo_ms": 2000.0}, r"\[--mux-itl-margin"),
])
def test_a_margin_outside_its_range_or_without_a_ttft_slo_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**fields)


def test_the_engine_runs_pressed_and_reports_it():
    """The tiny model on the CPU with the pressure on: outputs as with it off (only the
    step sizes may differ), and the margin in the engine info."""
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i % 200 for i in range(n)]}
               for n in (40, 300, 120, 700)]
    outputs = {}
    for margin in (0.0, 1.0, 1.2):
        llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
                  ttft_slo_ms=1.0, mux_ttft_pressed_margin=margin)
        assert llm.engine.describe()["ttft_pressed_margin"] == margin
        outputs[margin] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[0.0] == outputs[1.0] == outputs[1.2]


def test_the_goodput_configs_bank_beside_the_pressure_serve_the_same_tokens():
    """The two ShareGPT-like candidates' planner flags (the TPOT bank at the 5% quantile up
    to 1.2x beside the pressure at 1.05x; with SM splits reweighed, and mixed steps only)
    on the tiny model: the same tokens as the defaults, and what ran in the engine info."""
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i % 200 for i in range(n)]}
               for n in (40, 300, 120, 700)]
    candidate = dict(ttft_slo_ms=1.0, mux_ttft_pressed_margin=1.05, mux_tpot_bank_cap=1.2,
                     mux_tpot_bank_quantile=0.05)
    outputs = []
    for options in ({}, {**candidate, "mux_reweigh_spatial_batches": True},
                    {**candidate, "mux_sharing": "temporal"}):
        llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
                  **options)
        info = llm.engine.describe()
        # The defaults: the bank to 2x, no pressure without a TTFT SLO.
        assert info["ttft_pressed_margin"] == options.get("mux_ttft_pressed_margin", 0.0)
        assert info["tpot_bank_cap"] == options.get("mux_tpot_bank_cap", 2.0)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1] == outputs[2]


def test_the_pressed_margin_defaults_to_1_05_with_a_ttft_slo_and_off_without():
    from pdserve.config import SchedulerConfig

    assert SchedulerConfig().ttft_pressed_margin() == 0.0
    assert SchedulerConfig(ttft_slo_ms=2000.0).ttft_pressed_margin() == 1.05
    assert SchedulerConfig(ttft_slo_ms=2000.0,
                           mux_ttft_pressed_margin=0.0).ttft_pressed_margin() == 0.0
    with pytest.raises(ValueError, match="set --ttft-slo-ms"):
        SchedulerConfig(mux_ttft_pressed_margin=1.05)  # named without an SLO: not ignored
