"""The planner weighs each option over the work it commits to, not over its next cycle.

Planned with the latency model fitted on the committed H200 profile rows of the 6f90be1
run (codellama-34b, 132 SMs), beside a decode batch of 2 (16K tokens of context each) at
an ITL target of 80 ms, with mixed steps running 1.3x their profile (the online
correction a serving run learned): the case where the planner that judged by one cycle
took mixed steps and fell 12% below spatial alone."""

from __future__ import annotations

import pytest

from pdserve.sched.mux_planner import (
    DecodeLoad,
    InFlightPrefill,
    MuxMode,
    MuxPlan,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)

SPLITS = [(16, 116), (24, 108), (32, 100), (48, 84), (64, 68)]
ITL, DECODE, PROMPT = 80.0, DecodeLoad(2, 2 * 16000), 16000


@pytest.fixture(scope="module")
def h200(fitted_6f90be1) -> OnlineCalibration:
    model = OnlineCalibration(fitted_6f90be1)
    model.mixed_correction = 1.3
    return model


def planner(model, *sharing: str) -> MuxPlanner:
    options = {name: name in sharing for name in ("temporal", "time_slice", "spatial")}
    config = MuxPlannerConfig(itl_slo_ms=ITL, max_prefill_tokens=24576, **options)
    return MuxPlanner(model, SPLITS, config)


def mixed_steps_ms(model, prefix: int, tokens: int) -> float:
    """Predicted time of the mixed steps a temporal-only planner takes through ``tokens``
    prompt tokens that start at ``prefix``."""
    mixed, ms, done = planner(model, "temporal"), 0.0, 0
    while done < tokens:
        plan = mixed.plan(DECODE, [PrefillRequest(tokens - done, prefix + done)])
        assert plan.mode == MuxMode.TEMPORAL and plan.meets_slo
        ms, done = ms + plan.cycle_ms, done + plan.prefill.num_tokens
    return ms


def batch_run_ms(model, first: MuxPlan, *sharing: str) -> float:
    """Predicted time from ``first`` (a batch's first piece) until the batch's last layer,
    its later pieces planned with ``sharing``; every piece fits in its cycle."""
    piece, ms = first.prefill, first.cycle_ms
    layers = piece.start_layer + piece.num_layers
    while layers < model.num_layers:
        flight = InFlightPrefill(piece.num_tokens, piece.context_tokens, piece.batch_size,
                                 layers)
        plan = planner(model, *sharing).plan(DECODE, [], flight)
        assert plan.meets_slo and plan.prefill.predicted_ms <= plan.cycle_ms
        ms, layers = ms + plan.cycle_ms, layers + plan.prefill.num_layers
    return ms


def test_a_spatial_batch_beats_mixed_steps_that_look_faster_for_one_cycle(h200):
    full = planner(h200, "temporal", "time_slice", "spatial")
    waiting = [PrefillRequest(PROMPT)]
    options = {plan.mode: plan for plan in full.options(DECODE, waiting)}
    mixed, split = options[MuxMode.TEMPORAL], options[MuxMode.SPATIAL]
    # Judged by the next cycle, the mixed step wins (what the planner used to pick) ...
    assert mixed.prefill_tokens_per_s > split.prefill_tokens_per_s
    assert full.plan(DECODE, waiting).mode == MuxMode.SPATIAL
    # ... but over the batch the split starts, its run is shorter than mixed steps through
    # the same tokens, each as the single-option planners would run them.
    tokens = split.prefill.num_tokens
    split_ms = batch_run_ms(h200, split, "spatial")
    mixed_ms = mixed_steps_ms(h200, 0, tokens)
    assert split_ms < 0.95 * mixed_ms
    assert split.committed_tokens_per_s == pytest.approx(1e3 * tokens / split_ms, rel=1e-6)
    assert mixed.committed_tokens_per_s == pytest.approx(1e3 * tokens / mixed_ms, rel=1e-6)


def test_a_batch_pays_its_short_last_piece_as_a_whole_cycle(h200):
    """A batch in flight whose layers left split unevenly into time slices runs a short last
    piece whose decode step still costs a full cycle."""
    flight = InFlightPrefill(896, context_tokens=15000, batch_size=1, layers_done=10)
    plan = planner(h200, "time_slice").plan(DECODE, [], flight)
    left = h200.num_layers - flight.layers_done
    assert plan.mode == MuxMode.TIME_SLICE and left % plan.prefill.num_layers
    run_ms = batch_run_ms(h200, plan, "time_slice")
    expected = 1e3 * flight.num_tokens * left / h200.num_layers / run_ms
    assert plan.committed_tokens_per_s == pytest.approx(expected, rel=1e-6)
    assert plan.committed_tokens_per_s < 0.95 * plan.prefill_tokens_per_s


def test_mixed_steps_that_stop_fitting_on_the_way_count_no_progress(h200):
    """A prompt whose smallest mixed step fits now but not once the prefix has grown by
    the batch a time slice would start: mixed steps cannot finish that work."""
    mixed = planner(h200, "temporal")
    fits = lambda prefix: mixed.plan(DECODE, [PrefillRequest(64, prefix)]).mode == MuxMode.TEMPORAL
    lo, hi = 0, 400_000  # the longest prefix at which a 64-token mixed step still fits
    assert fits(lo) and not fits(hi)
    while hi - lo > 64:
        lo, hi = ((lo + hi) // 2, hi) if fits((lo + hi) // 2) else (lo, (lo + hi) // 2)
    waiting = [PrefillRequest(PROMPT, prefix_tokens=lo - 256)]
    options = {p.mode: p for p in planner(h200, "temporal", "time_slice").options(DECODE,
                                                                                 waiting)}
    assert options[MuxMode.TEMPORAL].meets_slo and options[MuxMode.TEMPORAL].prefill_tokens_per_s
    assert options[MuxMode.TIME_SLICE].prefill.num_tokens > 256 + 64
    assert options[MuxMode.TEMPORAL].committed_tokens_per_s == 0.0
    assert planner(h200, "temporal", "time_slice").plan(DECODE, waiting).mode == \
        MuxMode.TIME_SLICE
