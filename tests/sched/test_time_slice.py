"""TIME_SLICE against SPATIAL and TEMPORAL, planned with the latency model fitted on the
committed H200 rows (codellama-34b, 132 SMs, splits of 16 / 32 / 64 decode SMs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.sched.mux_planner import (
    DecodeLoad,
    InFlightPrefill,
    ItlUseLog,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    PrefillRequest,
    itl_use,
)
from pdserve.sched.predictor import LatencyPredictor

H200_ROWS = Path(__file__).parent.parent / "data" / "h200_codellama34b_profile_rows.json"
SPLITS = [(16, 116), (32, 100), (64, 68)]
SMS, LAYERS, ITL = 132, 48, 60.0


@pytest.fixture(scope="module")
def h200() -> LatencyPredictor:
    rows = json.loads(H200_ROWS.read_text())["runs"]["run_slo60"]
    return LatencyPredictor.fit(rows, gpu_name="NVIDIA H200", model_name="codellama-34b",
                                num_layers=LAYERS)


def planner(model, itl: float = ITL, **options) -> MuxPlanner:
    config = MuxPlannerConfig(itl_slo_ms=itl, **{"time_slice": True, **options})
    return MuxPlanner(model, SPLITS, config)


def decode_of(batch: int, context_each: int) -> DecodeLoad:
    return DecodeLoad(batch, batch * context_each)


# Long prompts (LooGLE-like, 12-20K tokens) part-way through prefill: what waits beside
# a small decode batch near saturation.
LONG_PROMPT_REST = [[PrefillRequest(8000, prefix_tokens=8192)],
                    [PrefillRequest(4000, prefix_tokens=12000), PrefillRequest(16000)]]


# Refitted with a piece's first prefix pairs apart (format 4), a split beside 1-4 decodes
# of 16K tokens (16-32 decode SMs, 100-116 left to prefill) is predicted to prefill 10-25%
# faster than time slicing (on the H200 time slicing was measured not to beat it). Time
# slicing stays ahead where the batch needs the 64-SM split, which leaves prefill 68 SMs:
# 5-8 decodes of 16K.
FEW_DECODES, SPLIT_64_DECODES = [1, 2, 3], [5, 6, 8]


@pytest.mark.parametrize("batch", SPLIT_64_DECODES)
@pytest.mark.parametrize("waiting", LONG_PROMPT_REST)
def test_small_decode_batches_time_slice_faster_than_spatial(h200, batch, waiting):
    decode = decode_of(batch, 16000)
    plan = planner(h200, temporal=False).plan(decode, waiting)
    spatial = planner(h200, temporal=False, time_slice=False).plan(decode, waiting)
    assert spatial.mode == MuxMode.SPATIAL and spatial.meets_slo and spatial.decode_sms == 64
    assert plan.mode == MuxMode.TIME_SLICE and plan.meets_slo
    assert plan.prefill_tokens_per_s > spatial.prefill_tokens_per_s


@pytest.mark.parametrize("batch", FEW_DECODES)
@pytest.mark.parametrize("waiting", LONG_PROMPT_REST)
def test_beside_a_few_decodes_the_faster_split_is_chosen_over_time_slicing(h200, batch, waiting):
    decode = decode_of(batch, 16000)
    plan = planner(h200, temporal=False).plan(decode, waiting)
    sliced = planner(h200, temporal=False, spatial=False).plan(decode, waiting)
    assert sliced.mode == MuxMode.TIME_SLICE and sliced.meets_slo
    assert plan.mode == MuxMode.SPATIAL and plan.meets_slo and plan.decode_sms < 64
    assert plan.prefill_tokens_per_s > sliced.prefill_tokens_per_s


def test_a_time_slice_plan_carries_what_the_engine_runs(h200):
    decode, waiting = decode_of(SPLIT_64_DECODES[1], 16000), LONG_PROMPT_REST[0]
    plan = planner(h200, temporal=False).plan(decode, waiting)
    assert plan.mode == MuxMode.TIME_SLICE
    piece = plan.prefill
    assert plan.decode_sms == plan.prefill_sms == SMS
    assert plan.decode_ms == h200.predict("decode", decode.batch_size, decode.context_tokens,
                                          decode.batch_size, SMS)
    assert piece.predicted_ms == h200.predict("prefill", piece.num_tokens,
                                              piece.context_tokens, piece.batch_size, SMS,
                                              False, piece.num_layers)
    assert piece.start_layer == 0 and 1 <= piece.num_layers < LAYERS
    assert plan.cycle_ms == pytest.approx(plan.decode_ms + piece.predicted_ms)
    assert plan.cycle_ms <= 0.9 * ITL
    progress = piece.num_tokens * piece.num_layers / LAYERS / plan.cycle_ms * 1e3
    assert plan.prefill_tokens_per_s == pytest.approx(progress)


def test_a_batch_in_flight_continues_on_the_whole_gpu(h200):
    flight = InFlightPrefill(num_tokens=4000, context_tokens=12000, batch_size=1,
                             layers_done=10)
    plan = planner(h200).plan(decode_of(SPLIT_64_DECODES[1], 16000), [], in_flight=flight)
    assert plan.mode == MuxMode.TIME_SLICE
    piece = plan.prefill
    assert piece.chunks == () and piece.start_layer == 10
    one_more = h200.predict("prefill", 4000, 12000, 1, SMS, False, piece.num_layers + 1)
    assert plan.decode_ms + one_more > 0.9 * ITL  # it took every layer that fits


# With a piece's first prefix pairs priced apart, the 16K prompt's later 256-token chunks
# over a long prefix cost more per pair, and from 64 decodes (or 32 of 8K) the time slices'
# larger pieces commit to more of the prompt per second than the mixed steps do.
@pytest.mark.parametrize("batch, context_each", [(32, 4000), (48, 4000)])
def test_large_decode_batches_mix_instead(h200, batch, context_each):
    """Decode takes half the budget alone; a mixed step reads the weights once for both."""
    decode, waiting = decode_of(batch, context_each), [PrefillRequest(16000)]
    sliced = planner(h200, temporal=False, spatial=False).plan(decode, waiting)
    assert sliced.decode_ms >= 0.4 * 0.9 * ITL
    plan = planner(h200).plan(decode, waiting)
    assert plan.mode == MuxMode.TEMPORAL
    assert plan.prefill_tokens_per_s > sliced.prefill_tokens_per_s


def test_slices_shrink_as_the_decode_step_grows(h200):
    only = planner(h200, temporal=False, spatial=False)
    rates = [only.plan(decode_of(b, 4000), [PrefillRequest(16000)]).prefill_tokens_per_s
             for b in (1, 16, 64)]
    assert rates[0] > rates[1] > rates[2] > 0


def test_no_time_slice_when_decode_alone_breaks_the_budget(h200):
    decode = decode_of(1, 16000)  # about 19 ms alone on the whole GPU
    options = planner(h200, itl=20.0).options(decode, [PrefillRequest(16000)])
    assert not any(p.mode == MuxMode.TIME_SLICE for p in options)


def test_time_slice_is_offered_only_when_enabled(h200):
    decode, waiting = decode_of(2, 16000), LONG_PROMPT_REST[0]
    default = MuxPlanner(h200, SPLITS, MuxPlannerConfig(itl_slo_ms=ITL))
    assert not any(p.mode == MuxMode.TIME_SLICE for p in default.options(decode, waiting))


# ------------------------------------------------------------ the ITL budget is used


def test_plans_sit_near_the_itl_target_while_prefill_waits(h200):
    mux, log = planner(h200), ItlUseLog(ITL)
    for batch in (1, 2, 3, 8):
        for waiting in LONG_PROMPT_REST + [[PrefillRequest(16000)]]:
            plan = mux.plan(decode_of(batch, 12000), waiting)
            log.add(plan)
            assert mux.itl_use(plan) == itl_use(plan, ITL) == plan.cycle_ms / ITL
    log.add(mux.plan(decode_of(2, 12000), []))  # nothing waits: not counted
    summary = log.summary()
    assert summary["n"] == 12
    assert 0.8 <= summary["p10"] <= summary["p50"] <= summary["max"] <= 0.9


def test_itl_use_log_quantiles():
    log = ItlUseLog(10.0)
    assert log.summary() == {"n": 0}
    for cycle in range(1, 11):
        log.values.append(cycle / 10)
    assert log.summary() == pytest.approx({"n": 10, "mean": 0.55, "p10": 0.1, "p50": 0.5,
                                           "p90": 0.9, "max": 1.0})


def test_a_batch_whose_first_tokens_cost_more_than_all_of_them_is_still_planned(h200):
    """The first 64 tokens of a prompt over an 834-token prefix are priced above the batch
    of those and a 1-token prompt (pairs are averaged over the batch's requests); the
    planner once found no piece then and raised (found by the property below)."""
    for itl, decode in ((40.0, decode_of(1, 8000)), (15.0, decode_of(1, 100))):
        mux = planner(h200, itl=itl)
        waiting = [PrefillRequest(64, 834), PrefillRequest(1, 0)]
        plan = mux.plan(decode, waiting)
        assert plan in mux.options(decode, waiting)


# ----------------------------------------------------------------- properties

requests = st.builds(PrefillRequest, st.integers(1, 20000), st.integers(0, 16000),
                     st.floats(0, 3000))
flights = st.none() | st.builds(InFlightPrefill, st.integers(64, 8192), st.integers(0, 16000),
                                st.just(1), st.integers(0, LAYERS - 1))


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 256), context_each=st.integers(100, 16000),
       waiting=st.lists(requests, min_size=1, max_size=3), in_flight=flights,
       itl=st.floats(15.0, 120.0))
def test_the_chosen_cycle_meets_the_itl_target_whenever_an_option_does(
        h200, batch, context_each, waiting, in_flight, itl):
    mux = planner(h200, itl=itl)
    decode = decode_of(batch, context_each)
    plan = mux.plan(decode, waiting, in_flight)
    options = mux.options(decode, waiting, in_flight)
    assert plan in options
    if any(p.cycle_ms <= itl for p in options):
        assert plan.cycle_ms <= itl
    if plan.mode == MuxMode.TIME_SLICE:
        assert plan.decode_sms == plan.prefill_sms == SMS
        assert plan.cycle_ms == pytest.approx(plan.decode_ms + plan.prefill.predicted_ms)
        assert plan.meets_slo == (plan.cycle_ms <= 0.9 * itl)
