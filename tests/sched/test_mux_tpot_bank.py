"""Banked TPOT slack (``MuxPlannerConfig.tpot_bank_cap``): a mixed step or a time slice may
run past the per-step ITL budget by what every request of the decode batch (or all but a
quantile of it, ``tpot_bank_quantile``) has banked against it (``banked_slack_ms``), up to
the cap; off by default.

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


def test_a_quantile_spends_the_bank_that_few_requests_fall_short_of():
    """Nine requests with 580 ms banked and one that just joined (54 ms): the tightest
    bank is the newcomer's; at quantile 0.1 one request in ten may have less than the bank
    spent, so the others' 580 ms is; at 0.05 (under one request in ten) still 54 ms."""
    batch = [_request(20, 0.5)] * 9 + [_request(1, 0.0)]
    slack = lambda q: banked_slack_ms(batch, 54.0, now=100.0, quantile=q)
    assert slack(0.0) == slack(0.05) == pytest.approx(54.0)
    assert slack(0.1) == slack(0.5) == pytest.approx(580.0)
    assert banked_slack_ms([], 54.0, now=100.0, quantile=0.1) is None
    assert banked_slack_ms(batch + [_request(3, None)], 54.0, now=100.0, quantile=0.1) is None


@pytest.mark.parametrize("quantile, cap, error", [
    (1.0, 3.0, "must be in"), (-0.1, 3.0, "must be in"), (float("nan"), 3.0, "must be in"),
    (0.1, 0.0, "needs --mux-tpot-bank-cap")])
def test_a_quantile_outside_0_1_or_without_the_bank_is_refused(quantile, cap, error):
    with pytest.raises(ValueError, match=error):
        SchedulerConfig(mux_tpot_bank_cap=cap, mux_tpot_bank_quantile=quantile)


def test_the_scheduler_plans_with_the_quantile_it_is_given():
    """The decode load the multiplex scheduler plans with carries the bank at the quantile
    its config names."""
    from pdserve.sched.in_flight import decode_load_banked

    batch = [SimpleNamespace(num_tokens=500, **vars(_request(20, 0.5)))] * 9
    batch.append(SimpleNamespace(num_tokens=300, **vars(_request(1, 0.0))))
    config = MuxPlannerConfig(itl_slo_ms=60.0, tpot_bank_cap=3.0)
    tightest = decode_load_banked(batch, config, now=100.0)
    spread = decode_load_banked(batch, replace(config, tpot_bank_quantile=0.1), now=100.0)
    assert tightest.slack_ms == pytest.approx(54.0)
    assert spread.slack_ms == pytest.approx(580.0)
    assert (spread.batch_size, spread.context_tokens) == (10, 4800)


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
    for cap, quantile in ((0.0, 0.0), (3.0, 0.0), (3.0, 0.1)):
        llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
                  mux_tpot_bank_cap=cap, mux_tpot_bank_quantile=quantile)
        described = llm.engine.describe()
        assert (described["tpot_bank_cap"], described["tpot_bank_quantile"]) == (cap, quantile)
        outputs[cap, quantile] = [o.outputs[0].token_ids
                                  for o in llm.generate(prompts, params)]
    assert outputs[0.0, 0.0] == outputs[3.0, 0.0] == outputs[3.0, 0.1]
