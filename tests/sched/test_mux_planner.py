from __future__ import annotations

import pytest

from pdserve.config import SchedulerConfig
from pdserve.sched.multiplex import mux_planner_config
from pdserve.sched.mux_planner import (
    DecodeLoad,
    InFlightPrefill,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)

LAYERS, SMS = 10, 100
PARTITIONS = [(d, SMS - d) for d in range(10, 100, 10)]


class HandModel:
    """A GPU of 100 SMs in round numbers. Whole-GPU prefill: 5 ms + 0.1 ms per token;
    decode: 5 ms + 0.1 ms per request + 0.1 ms per 1K context tokens; a mixed step reads
    the weights once for both. Co-running costs decode x1.15 and prefill x1.2."""

    num_layers, total_sms = LAYERS, SMS

    def predict(self, phase, num_tokens, context_tokens, batch_size, sms, co_running=False,
                num_layers=None):
        if phase == "decode":
            ms = (5 + 0.1 * batch_size + context_tokens / 1e4) * (SMS / sms) ** 0.3
            return ms * (1.15 if co_running and sms < SMS else 1.0)
        share = (num_layers or LAYERS) / LAYERS
        ms = share * (5 + 0.1 * num_tokens) * SMS / sms
        return ms * (1.2 if co_running and sms < SMS else 1.0)

    def predict_mixed(self, prefill_tokens, prefill_context, prefill_batch, decode_batch,
                      decode_context, sms=None):
        return 5 + 0.1 * (prefill_tokens + decode_batch) + decode_context / 1e4


def planner(itl=50.0, **kw) -> MuxPlanner:
    config = MuxPlannerConfig(itl_slo_ms=itl, token_align=8, min_chunk_tokens=16, **kw)
    return MuxPlanner(HandModel(), PARTITIONS, config)


HEAVY = DecodeLoad(batch_size=32, context_tokens=32 * 6000)
LIGHT = DecodeLoad(batch_size=4, context_tokens=4 * 500)
PROMPTS = [PrefillRequest(6000), PrefillRequest(3000, prefix_tokens=1000)]


def test_heavy_decode_goes_spatial_on_the_smallest_partition_that_meets_the_slo():
    plan = planner().plan(HEAVY, PROMPTS)
    model, budget = HandModel(), 50.0 * 0.9
    assert plan.mode == MuxMode.SPATIAL and plan.meets_slo
    fits = [d for d, _ in PARTITIONS
            if model.predict("decode", 32, HEAVY.context_tokens, 32, d, True) <= budget]
    assert plan.decode_sms == fits[0] == 40
    assert plan.prefill_sms == SMS - plan.decode_sms
    assert plan.decode_ms <= budget


def test_spatial_piece_lasts_about_one_decode_step():
    plan = planner().plan(HEAVY, PROMPTS)
    piece = plan.prefill
    assert piece.start_layer == 0 and 1 <= piece.num_layers <= LAYERS
    assert 0.8 * plan.decode_ms <= piece.predicted_ms <= plan.decode_ms
    assert piece.chunks[0] == (0, min(6000, piece.num_tokens))  # first come, first served


def test_light_decode_goes_temporal_with_the_largest_chunk_that_fits():
    plan = planner().plan(LIGHT, PROMPTS)
    model, budget = HandModel(), 45.0
    assert plan.mode == MuxMode.TEMPORAL and plan.meets_slo
    assert plan.decode_sms == plan.prefill_sms == SMS
    chunk = plan.prefill.num_tokens
    assert model.predict_mixed(chunk, 0, 1, 4, 2000) <= budget
    assert model.predict_mixed(chunk + 8, 0, 1, 4, 2000) > budget
    assert plan.prefill.num_layers == LAYERS


def test_choice_follows_predicted_prefill_progress():
    tp = planner(spatial=False).plan(LIGHT, PROMPTS)
    sp = planner(temporal=False).plan(LIGHT, PROMPTS)
    best = planner().plan(LIGHT, PROMPTS)
    assert best.prefill_tokens_per_s == max(tp.prefill_tokens_per_s, sp.prefill_tokens_per_s)


def test_no_decode_gives_prefill_the_whole_gpu_in_one_big_piece():
    plan = planner().plan(None, PROMPTS)
    assert plan.mode == MuxMode.PREFILL_ONLY
    assert plan.prefill_sms == SMS
    assert plan.prefill.num_layers == LAYERS  # all layers at once, no crawl
    assert plan.prefill.num_tokens == 8192  # the batch is as large as allowed
    assert plan.prefill.chunks == ((0, 6000), (1, 2192))


def test_no_decode_finishes_an_in_flight_batch_at_once():
    flight = InFlightPrefill(num_tokens=4096, context_tokens=0, batch_size=1, layers_done=3)
    plan = planner().plan(DecodeLoad(0, 0), PROMPTS, in_flight=flight)
    assert plan.mode == MuxMode.PREFILL_ONLY
    assert (plan.prefill.start_layer, plan.prefill.num_layers) == (3, LAYERS - 3)
    assert plan.prefill.chunks == ()


def test_in_flight_batch_continues_spatially_with_the_layers_that_fit():
    flight = InFlightPrefill(num_tokens=2000, context_tokens=0, batch_size=1, layers_done=8)
    plan = planner().plan(LIGHT, PROMPTS, in_flight=flight)
    assert plan.mode == MuxMode.SPATIAL  # a mixed step cannot resume a batch mid-model
    piece = plan.prefill
    assert piece.start_layer == 8 and 1 <= piece.num_layers <= 2
    model = HandModel()
    longer = model.predict("prefill", 2000, 0, 1, plan.prefill_sms, True, piece.num_layers + 1)
    assert piece.num_layers == 2 or longer > plan.decode_ms


def test_when_nothing_meets_the_slo_the_lowest_decode_latency_wins():
    huge = DecodeLoad(batch_size=64, context_tokens=64 * 30000)
    plan = planner(itl=20.0).plan(huge, PROMPTS)
    assert not plan.meets_slo
    assert plan.mode == MuxMode.DECODE_ONLY and plan.prefill is None
    spatial = planner(itl=20.0, temporal=False).plan(huge, PROMPTS)
    assert plan.decode_ms <= spatial.decode_ms


def test_decode_alone_and_idle():
    assert planner().plan(LIGHT, []).mode == MuxMode.DECODE_ONLY
    assert planner().plan(None, []).mode == MuxMode.IDLE
    assert planner().plan(None, [PrefillRequest(0)]).mode == MuxMode.IDLE


def test_ttft_slo_caps_the_batch_behind_an_old_request():
    waiting = [PrefillRequest(2000, waited_ms=900), PrefillRequest(6000)]
    plan = planner(ttft_slo_ms=1200).plan(None, waiting)
    # 300 ms of slack left: 5 + 0.1 * 2944 fits, the 8000 tokens waiting (805 ms) do not.
    assert plan.prefill.num_tokens == 2944
    relaxed = planner().plan(None, waiting)
    assert relaxed.prefill.num_tokens == 8000


def test_ttft_slo_cap_follows_the_request_served_first():
    # Under the SLO order a prompt past its deadline waits behind one that can still meet
    # it: the batch is capped by the front prompt's slack, not shrunk to the late one's size.
    waiting = [PrefillRequest(2000, waited_ms=100), PrefillRequest(6000, waited_ms=1500)]
    plan = planner(ttft_slo_ms=1200).plan(None, waiting)
    assert plan.prefill.num_tokens == 8000


def test_prefill_waits_for_decode_only_up_to_its_stall_limit():
    huge = DecodeLoad(batch_size=64, context_tokens=64 * 30000)
    fresh = [PrefillRequest(6000, waited_ms=100)]
    old = [PrefillRequest(6000, waited_ms=2500)]
    temporal_only = planner(itl=20.0, spatial=False, max_prefill_stall_ms=2000)
    assert temporal_only.plan(huge, fresh).mode == MuxMode.DECODE_ONLY
    plan = temporal_only.plan(huge, old)
    assert plan.mode == MuxMode.TEMPORAL and not plan.meets_slo
    assert plan.prefill.num_tokens == 16  # the smallest chunk: least harm to decode
    both = planner(itl=20.0, max_prefill_stall_ms=2000).plan(huge, old)
    assert both.prefill is not None and both.prefill.num_tokens > 0
    assert both.decode_ms == min(plan.decode_ms, planner(itl=20.0, temporal=False,
                                                         max_prefill_stall_ms=2000)
                                 .plan(huge, old).decode_ms)


def test_measured_mixed_steps_shrink_the_chunk_until_it_fits():
    model = OnlineCalibration(HandModel())
    plan = MuxPlanner(model, PARTITIONS, MuxPlannerConfig(
        itl_slo_ms=50.0, token_align=8, min_chunk_tokens=16, spatial=False))
    first = plan.plan(LIGHT, PROMPTS)
    for _ in range(30):  # the GPU runs mixed steps 25% slower than the model says
        step = plan.plan(LIGHT, PROMPTS)
        model.observe_mixed(step.decode_ms, 1.25 * step.decode_ms / model.mixed_correction)
    later = plan.plan(LIGHT, PROMPTS)
    assert model.mixed_correction == pytest.approx(1.25, rel=0.02)
    assert later.prefill.num_tokens < first.prefill.num_tokens
    true_ms = 1.25 * HandModel().predict_mixed(later.prefill.num_tokens, 0, 1, 4, 2000)
    assert true_ms <= 50.0 * 0.9


def test_calibration_is_bounded_and_ignores_nonsense():
    model = OnlineCalibration(HandModel(), bounds=(0.5, 2.0))
    for _ in range(100):
        model.observe_mixed(10.0, 1e6)
    assert model.mixed_correction == pytest.approx(2.0)
    model.observe_mixed(0.0, 5.0)
    model.observe_mixed(5.0, -1.0)
    assert model.mixed_correction == pytest.approx(2.0)
    assert model.predict("decode", 4, 2000, 4, 100) == HandModel().predict(
        "decode", 4, 2000, 4, 100)


def test_one_odd_step_cannot_lock_mixed_steps_out():
    """A step that ran 16x its prediction (kernels compiled on first use, on a fresh GPU
    host) moves the correction a few percent at most, and ordinary steps bring it back."""
    model = OnlineCalibration(HandModel())
    model.observe_mixed(50.0, 830.0)
    assert 1.0 < model.mixed_correction <= 1.25 ** 0.2 + 1e-9
    for _ in range(40):
        predicted = 50.0 * model.mixed_correction
        model.observe_mixed(predicted, 50.0)  # the GPU runs what the profile says
    assert model.mixed_correction == pytest.approx(1.0, abs=0.01)


def test_decode_measured_faster_than_predicted_moves_to_a_smaller_partition():
    """Co-running decode steps that run at 0.8 of their prediction let decode take fewer
    SMs (prefill more) while the true step still fits the budget; decode alone is
    untouched."""
    model = OnlineCalibration(HandModel())
    plan = MuxPlanner(model, PARTITIONS, MuxPlannerConfig(
        itl_slo_ms=50.0, token_align=8, min_chunk_tokens=16, temporal=False))
    first = plan.plan(HEAVY, PROMPTS)
    for _ in range(60):
        step = plan.plan(HEAVY, PROMPTS)
        truth = 0.8 * HandModel().predict("decode", 32, HEAVY.context_tokens, 32,
                                          step.decode_sms, True)
        model.observe_decode(step.decode_ms, truth)
    later = plan.plan(HEAVY, PROMPTS)
    assert later.mode == MuxMode.SPATIAL and later.decode_sms < first.decode_sms
    truth = 0.8 * HandModel().predict("decode", 32, HEAVY.context_tokens, 32,
                                      later.decode_sms, True)
    assert truth <= 50.0 * 0.9
    assert model.predict("decode", 4, 2000, 4, 50) == HandModel().predict(
        "decode", 4, 2000, 4, 50)


def test_decode_alone_slower_than_predicted_shrinks_time_slice_pieces_to_the_budget():
    """Whole-GPU decode steps that run at 1.3x their prediction (decode-only steps, time
    slices' decodes) teach their own factor: the time slice's piece shrinks until the true
    cycle fits the budget again; co-running decode and an SM split's decode keep theirs."""
    model = OnlineCalibration(HandModel())
    plan = MuxPlanner(model, PARTITIONS, MuxPlannerConfig(
        itl_slo_ms=50.0, token_align=8, min_chunk_tokens=16, temporal=False, spatial=False,
        time_slice=True))
    first = plan.plan(HEAVY, PROMPTS)
    assert first.mode == MuxMode.TIME_SLICE
    truth = lambda: 1.3 * HandModel().predict("decode", 32, HEAVY.context_tokens, 32, SMS)
    assert truth() + first.prefill.predicted_ms > 50.0 * 0.9  # the true cycle overshoots
    for _ in range(60):
        step = plan.plan(HEAVY, PROMPTS)
        model.observe_decode(step.decode_ms, truth(), alone=True)
    later = plan.plan(HEAVY, PROMPTS)
    assert model.alone_decode_correction == pytest.approx(1.3, rel=0.02)
    assert later.mode == MuxMode.TIME_SLICE
    assert later.prefill.predicted_ms < first.prefill.predicted_ms
    assert truth() + later.prefill.predicted_ms <= 50.0 * 0.9 + 1e-6
    assert model.decode_correction == 1.0
    assert model.predict("decode", 4, 2000, 4, 50) == HandModel().predict(
        "decode", 4, 2000, 4, 50)


@pytest.mark.parametrize("align, chunk", [(8, 392), (64, 384)])
def test_mixed_chunks_are_the_largest_multiple_of_the_alignment_that_fits(align, chunk):
    # Beside 4 decodes at 2K context: 5 + 0.1 * (chunk + 4) + 0.2 <= 45 ms up to 394 tokens.
    config = MuxPlannerConfig(itl_slo_ms=50.0, token_align=align, min_chunk_tokens=16,
                              spatial=False)
    plan = MuxPlanner(HandModel(), PARTITIONS, config).plan(LIGHT, PROMPTS)
    assert plan.mode == MuxMode.TEMPORAL and plan.prefill.num_tokens == chunk


def test_the_token_alignment_flag_reaches_the_planner_and_is_checked():
    sched = SchedulerConfig(schedule="multiplex", itl_slo_ms=60.0, mux_token_align=16)
    assert mux_planner_config(sched).token_align == 16
    assert mux_planner_config(SchedulerConfig(schedule="multiplex")).token_align == 64
    for bad in (0, 513):
        with pytest.raises(ValueError, match="--mux-token-align"):
            SchedulerConfig(schedule="multiplex", mux_token_align=bad)


@pytest.mark.parametrize("align, chunk", [(8, 388), (64, 380), (128, 380), (256, 252)])
def test_aligned_steps_count_the_decode_tokens_in_the_alignment(align, chunk):
    # Beside 4 decodes the step is chunk + 4 tokens: 392 (8 x 49), 384 (64 x 6, 128 x 3) fit
    # 45 ms; 512 (256 x 2) does not, so 256 does.
    config = MuxPlannerConfig(itl_slo_ms=50.0, token_align=align, min_chunk_tokens=16,
                              spatial=False, align_step_tokens=True)
    plan = MuxPlanner(HandModel(), PARTITIONS, config).plan(LIGHT, PROMPTS)
    assert plan.mode == MuxMode.TEMPORAL and plan.prefill.num_tokens == chunk
    assert (chunk + LIGHT.batch_size) % align == 0


@pytest.mark.parametrize("align_step, chunk", [(True, 252), (False, 256)])
def test_a_step_the_token_cap_cuts_is_aligned_too(align_step, chunk):
    # A budget that holds 380 tokens, a cap of 300: 256 with the 4 decodes (252 of prompt),
    # or 256 of prompt where the chunk alone is aligned.
    config = MuxPlannerConfig(itl_slo_ms=50.0, token_align=128, min_chunk_tokens=16,
                              spatial=False, align_step_tokens=align_step,
                              max_prefill_tokens=300)
    plan = MuxPlanner(HandModel(), PARTITIONS, config).plan(LIGHT, PROMPTS)
    assert plan.mode == MuxMode.TEMPORAL and plan.prefill.num_tokens == chunk


def test_the_aligned_steps_flag_reaches_the_planner():
    sched = SchedulerConfig(schedule="multiplex", itl_slo_ms=60.0, mux_align_step_tokens=True)
    assert mux_planner_config(sched).align_step_tokens is True
    assert mux_planner_config(SchedulerConfig(schedule="multiplex")).align_step_tokens is False
