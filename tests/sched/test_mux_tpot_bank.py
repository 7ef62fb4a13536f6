"""Banked TPOT slack (``MuxPlannerConfig.tpot_bank_cap``): a mixed step or a time slice may
run past the per-step ITL budget by what every request of the decode batch has banked
against it (``banked_slack_ms``), up to the cap; off by default.

Planned with the latency model of the committed d698fcb H200 profile (codellama-34b) at an
ITL target of 60 ms (a 54 ms budget) beside 5 decoding requests of ~11K tokens."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pdserve.config import SchedulerConfig
from pdserve.sched.mux_planner import (
    DecodeLoad,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
    banked_slack_ms,
)

SPLITS = [(16, 116), (24, 108), (32, 100), (48, 84), (64, 68)]
DECODE = DecodeLoad(5, 5 * 11000)
WAITING = [PrefillRequest(16000, 0)]


def plan_with(profile, slack_ms: float | None, cap: float, **options):
    config = MuxPlannerConfig(itl_slo_ms=60.0, tpot_bank_cap=cap,
                              **{"spatial": False, "time_slice": False, **options})
    planner = MuxPlanner(OnlineCalibration(profile), SPLITS, config)
    return planner.plan(replace(DECODE, slack_ms=slack_ms), WAITING)


def test_a_batch_with_slack_gets_a_larger_mixed_step_within_the_cap(profile_d698fcb):
    budget = plan_with(profile_d698fcb, None, cap=0.0)
    banked = plan_with(profile_d698fcb, 500.0, cap=2.5)
    assert budget.mode == banked.mode == MuxMode.TEMPORAL
    assert budget.cycle_ms <= 54.0 < banked.cycle_ms <= 150.0
    assert banked.prefill.num_tokens > budget.prefill.num_tokens
    assert banked.prefill_tokens_per_s > budget.prefill_tokens_per_s
    assert "banked TPOT slack" in banked.reason


def test_the_step_takes_no_more_than_the_tightest_request_banked(profile_d698fcb):
    plan = plan_with(profile_d698fcb, 90.0, cap=2.5)
    assert 54.0 < plan.cycle_ms <= 90.0


def test_without_slack_or_with_the_cap_off_the_budget_holds(profile_d698fcb):
    budget = plan_with(profile_d698fcb, None, cap=0.0)
    assert plan_with(profile_d698fcb, 500.0, cap=0.0) == budget  # off: slack ignored
    assert plan_with(profile_d698fcb, None, cap=2.5) == budget  # nothing banked
    assert plan_with(profile_d698fcb, 20.0, cap=2.5) == budget  # less than the budget


def test_a_time_slice_takes_the_banked_room_too(profile_d698fcb):
    options = {"temporal": False, "time_slice": True}
    budget = plan_with(profile_d698fcb, None, cap=0.0, **options)
    banked = plan_with(profile_d698fcb, 500.0, cap=2.5, **options)
    assert budget.mode == banked.mode == MuxMode.TIME_SLICE
    assert budget.cycle_ms <= 54.0 < banked.cycle_ms <= 150.0


def _request(outputs: int, first_token_s_ago: float | None, placeholders: int = 0):
    first = None if first_token_s_ago is None else 100.0 - first_token_s_ago
    return SimpleNamespace(num_output_tokens=outputs, num_placeholders=placeholders,
                           first_token_time=first)


def test_slack_is_the_tightest_requests_budget_times_its_tokens_less_its_time():
    # 20 tokens in 0.5 s: 20 x 54 - 500 = 580 ms; 1 token just now: 54 ms.
    assert banked_slack_ms([_request(20, 0.5)], 54.0, now=100.0) == pytest.approx(580.0)
    assert banked_slack_ms([_request(20, 0.5), _request(1, 0.0)], 54.0,
                           now=100.0) == pytest.approx(54.0)
    # A token still being sampled counts, and its step takes up to one budget first.
    assert banked_slack_ms([_request(19, 0.5, placeholders=1)], 54.0,
                           now=100.0) == pytest.approx(580.0 - 54.0)
    # Over its mean already: nothing banked (less than one budget).
    assert banked_slack_ms([_request(10, 1.0)], 54.0, now=100.0) < 0
    assert banked_slack_ms([_request(5, 0.1), _request(3, None)], 54.0, now=100.0) is None


@pytest.mark.parametrize("cap", [0.5, -1.0, float("nan")])
def test_a_cap_below_one_is_refused(cap):
    with pytest.raises(ValueError, match="--mux-tpot-bank-cap"):
        SchedulerConfig(mux_tpot_bank_cap=cap)


def test_the_engine_runs_with_the_bank_and_reports_it():
    """The tiny model on the CPU with the bank on: outputs as with it off (only the step
    sizes may differ), and the cap in the engine info."""
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i % 200 for i in range(n)]}
               for n in (40, 300, 120, 700)]
    outputs = {}
    for cap in (0.0, 3.0):
        llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
                  mux_tpot_bank_cap=cap)
        assert llm.engine.describe()["tpot_bank_cap"] == cap
        outputs[cap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[0.0] == outputs[3.0]
