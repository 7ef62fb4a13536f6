"""The planner learns what each sharing option's prefill pieces really take (rule 2's
correction) and holds the running option against small gains (rule 4's hysteresis).

Planned with the latency model fitted on the committed H200 profile rows of the 6f90be1
run (codellama-34b, 132 SMs) at an ITL target of 60 ms, beside one decoding request of
16K tokens of context, with a 16K-token prompt waiting: the LooGLE-like load where the
planner chose spatial batches their pieces did not deliver."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pdserve.sched.base import StepOutput
from pdserve.sched.multiplex import MultiplexScheduler, PieceNote, TimelineEntry
from pdserve.sched.mux_planner import (
    DecodeLoad,
    InFlightPrefill,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
    option_key,
    piece_predicted_ms,
)
from pdserve.sched.predictor import LatencyPredictor

SPLITS = [(16, 116), (24, 108), (32, 100), (48, 84), (64, 68)]
ITL, LAYERS = 60.0, 48
DECODE, PROMPT = DecodeLoad(1, 16000), [PrefillRequest(16000)]


@pytest.fixture(scope="module")
def fitted(fitted_6f90be1) -> LatencyPredictor:
    return fitted_6f90be1


def planner(model, **options) -> MuxPlanner:
    """Spatial against time slicing (mixed steps off: a batch in flight rules them out)."""
    config = MuxPlannerConfig(itl_slo_ms=ITL, max_prefill_tokens=24576,
                              **{"time_slice": True, "temporal": False, **options})
    return MuxPlanner(model, SPLITS, config)


def serve(plan_with: MuxPlanner, model: OnlineCalibration, slowdown: dict[str, float],
          decisions: int = 40, decode: DecodeLoad = DECODE) -> list[str]:
    """Plans ``decisions`` times, each piece taking ``slowdown[option]`` times its
    prediction (a fake clock: measured = factor x predicted) and reported as the engine
    reports a completed piece; returns the option chosen at each decision."""
    chosen, running = [], None
    for _ in range(decisions):
        plan = plan_with.plan(decode, PROMPT, None, running)
        predicted = piece_predicted_ms(plan)
        model.observe_prefill(plan.option, predicted, slowdown.get(plan.option, 1.0) * predicted)
        chosen.append(running := plan.option)
    return chosen


def test_spatial_pieces_slower_than_predicted_hand_the_prompt_to_time_slicing(fitted):
    model = OnlineCalibration(fitted)
    chosen = serve(planner(model), model, {"spatial:24": 1.3})
    assert chosen[0] == "spatial:24"  # predicted: 6.5K tokens/s against time slicing's 5.6K
    assert chosen[-10:] == ["time_slice"] * 10
    assert model.prefill_correction("spatial:24") > 1.2
    assert model.prefill_correction("time_slice") == pytest.approx(1.0)


def test_a_plan_names_the_option_it_beat_and_that_option_s_rate(fitted):
    model = OnlineCalibration(fitted)
    plan = planner(model).plan(DECODE, PROMPT)
    rivals = {p.option: p.weighed_tokens_per_s
              for p in planner(model).options(DECODE, PROMPT) if p.meets_slo}
    assert plan.option == "spatial:24" and plan.runner_up in rivals
    assert plan.runner_up != plan.option
    assert plan.runner_up_tokens_per_s == max(rate for option, rate in rivals.items()
                                              if option != plan.option)
    assert plan.runner_up_tokens_per_s <= plan.weighed_tokens_per_s


def test_spatial_pieces_that_run_as_predicted_keep_spatial(fitted):
    model = OnlineCalibration(fitted)
    chosen = serve(planner(model), model, {"spatial:24": 1.0, "time_slice": 1.0})
    assert set(chosen) == {"spatial:24"}
    assert model.prefill_correction("spatial:24") == pytest.approx(1.0)


def test_each_split_learns_on_its_own(fitted):
    model = OnlineCalibration(fitted)
    for _ in range(10):
        model.observe_prefill("spatial:24", 40.0, 50.0)
    assert model.prefill_correction("spatial:24") > 1.2
    assert model.prefill_correction("spatial:32") == model.prefill_correction(None) == 1.0
    assert model.describe_prefill() == {
        "spatial:24": {"correction": round(model.prefill_correction("spatial:24"), 4),
                       "pieces": 10}}
    # Co-running decode keeps its own correction, shared by the splits.
    assert model.decode_correction == 1.0


def test_one_piece_moves_a_correction_by_at_most_the_step_limit():
    model = OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132))
    model.observe_prefill("spatial:16", 50.0, 800.0)  # 16x: a cold kernel, a host stall
    assert model.prefill_correction("spatial:16") == pytest.approx(1.25 ** 0.2)
    model.observe_prefill("time_slice", 50.0, 50.0 / 16)
    assert model.prefill_correction("time_slice") == pytest.approx(1.25 ** -0.2)
    for predicted, measured in ((0.0, 50.0), (50.0, 0.0), (-1.0, 50.0)):
        model.observe_prefill("spatial:24", predicted, measured)
    assert model.prefill_correction("spatial:24") == 1.0  # nonsense moves nothing
    for _ in range(200):
        model.observe_prefill("spatial:16", 50.0, 500.0)
    assert model.prefill_correction("spatial:16") == pytest.approx(2.0)  # bounded


def test_without_online_learning_nothing_moves(fitted):
    """A model with no online calibration (the bare predictor) plans as before."""
    bare, calibrated = planner(fitted), planner(OnlineCalibration(fitted))
    assert bare.plan(DECODE, PROMPT) == calibrated.plan(DECODE, PROMPT)
    assert bare.plan(DECODE, PROMPT).prefill_calibration == 1.0


def _slow_spatial(fitted, spatial_over_slice: float) -> OnlineCalibration:
    """A model whose spatial:24 pieces are known to deliver ``spatial_over_slice`` of time
    slicing's committed rate."""
    model = OnlineCalibration(fitted)
    rates = {p.option: p.committed_tokens_per_s for p in planner(model).options(DECODE, PROMPT)}
    model.prefill_corrections["spatial:24"] = (
        rates["spatial:24"] / (spatial_over_slice * rates["time_slice"]))
    return model


def test_the_running_option_is_kept_against_a_gain_within_the_switch_margin(fitted):
    model = _slow_spatial(fitted, 0.99)
    assert planner(model).plan(DECODE, PROMPT).option == "time_slice"  # nothing running
    kept = planner(model).plan(DECODE, PROMPT, incumbent="spatial:24")
    assert kept.option == "spatial:24" and kept.held_over == "time_slice"
    assert planner(model, switch_margin=0.0).plan(DECODE, PROMPT, incumbent="spatial:24"
                                                  ).option == "spatial:24"  # switch cost


def test_a_clearly_better_option_takes_over_from_the_running_one(fitted):
    model = _slow_spatial(fitted, 0.8)
    plan = planner(model).plan(DECODE, PROMPT, incumbent="spatial:24")
    assert plan.option == "time_slice" and plan.held_over is None


def test_a_switch_is_not_worth_it_for_the_last_layers_of_a_batch(fitted):
    """Time slicing 10% ahead: worth a switch for a whole batch, not for its last layers
    (one cycle of idle prefill is more than 10% of what is left)."""
    model = _slow_spatial(fitted, 0.9)
    fresh = planner(model).plan(DECODE, PROMPT, incumbent="spatial:24")
    assert fresh.option == "time_slice"
    # The batch spatial:24 was running: a 6K prompt's, 4352 tokens 3 layers a piece. Fitted
    # with a piece's first prefix pairs apart (format 4) it takes the 16K prompt as 13K
    # tokens one layer a piece, and no time slice fits a layer of those beside this decode:
    # nothing to switch to.
    started = planner(fitted).plan(DECODE, [PrefillRequest(6144)])
    assert started.option == "spatial:24"
    flight = InFlightPrefill(started.prefill.num_tokens, 0, 1, LAYERS - 3)
    last = planner(model).plan(DECODE, [], flight, incumbent="spatial:24")
    assert last.option == "spatial:24" and last.held_over == "time_slice"


def _decode_near_budget(fitted, sms: int, low: float, high: float) -> DecodeLoad:
    """Two decoding requests with the context that puts their co-running step on ``sms``
    decode SMs between ``low`` and ``high`` of the budget."""
    budget = ITL * 0.9
    for context in range(20000, 40000, 25):
        ms = fitted.predict("decode", 2, context, 2, sms, True)
        if low * budget < ms <= high * budget:
            return DecodeLoad(2, context)
    raise AssertionError("no such context")


def test_a_smaller_split_is_re_entered_only_clear_of_the_budget(fitted):
    """Running on 32 decode SMs, a 24-SM step within 3% of the budget (where a percent of
    online correction flips it over) is not worth draining both lanes for."""
    edge = _decode_near_budget(fitted, 24, 0.975, 1.0)
    assert planner(fitted).plan(edge, PROMPT).option == "spatial:24"
    held = planner(fitted).plan(edge, PROMPT, incumbent="spatial:32")
    assert held.option == "spatial:32" and held.held_over == "spatial:24"
    clear = _decode_near_budget(fitted, 24, 0.85, 0.9)
    assert planner(fitted).plan(clear, PROMPT, incumbent="spatial:32").option == "spatial:24"


def test_the_split_stops_flapping_as_the_decode_correction_jitters(fitted):
    """The H200 run's pattern: a 24-SM step at the budget's edge, its co-running decode
    correction moving by about a percent each cycle, the split flipped 24 <-> 32 (the
    decode SMs the H200 run flipped between were 16 and 24) on every crossing."""
    edge = _decode_near_budget(fitted, 24, 0.99, 1.0)

    def switches(margin: float) -> int:
        model = OnlineCalibration(fitted)
        plan_with, running, count = planner(model, switch_margin=margin), None, 0
        for cycle in range(60):
            model.decode_correction = 1.015 if cycle % 10 < 5 else 0.99
            option = plan_with.plan(edge, PROMPT, None, running).option
            count += running is not None and option != running
            running = option
        return count

    assert switches(0.0) >= 10
    assert switches(0.03) <= 1


def test_a_completed_piece_reaches_the_timeline_and_its_options_correction():
    """What the multiplex policy does when the engine hands back a piece: the host's
    time from issue to completion goes to the piece's timeline entry and to its option's
    correction; a piece run with prefill alone is timed but teaches nothing."""
    model = OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132))
    policy = SimpleNamespace(model=model)
    entry = TimelineEntry(0.0, "spatial", 24, 108, 1, 4544, 3, 43.8, False, 43.8,
                          piece_launched=True, predicted_piece_ms=40.0)
    MultiplexScheduler._observe_piece(policy, PieceNote("spatial:24", 40.0, entry),
                                      StepOutput([], elapsed_ms=50.0))
    assert entry.measured_piece_ms == 50.0
    assert model.prefill_correction("spatial:24") == pytest.approx(1.25 ** 0.2)
    alone = replace(entry, mode="prefill_only", measured_piece_ms=0.0)
    MultiplexScheduler._observe_piece(policy, PieceNote(None, 40.0, alone),
                                      StepOutput([], elapsed_ms=80.0))
    assert alone.measured_piece_ms == 80.0 and list(model.prefill_corrections) == ["spatial:24"]


def test_a_time_slice_piece_is_predicted_its_whole_cycle(fitted):
    plan = planner(fitted, spatial=False).plan(DECODE, PROMPT)
    assert plan.mode == MuxMode.TIME_SLICE
    assert piece_predicted_ms(plan) == pytest.approx(plan.decode_ms + plan.prefill.predicted_ms)
    spatial = planner(fitted, time_slice=False).plan(DECODE, PROMPT)
    assert piece_predicted_ms(spatial) == spatial.prefill.predicted_ms < spatial.cycle_ms + 1


class SharingModel:
    """Latencies on a 132-SM GPU where decode and prefill share it in pieces (mixed steps
    never fit), for the tiny model on the CPU."""

    total_sms = 132

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def predict(self, phase, num_tokens, context_tokens, batch_size, sms, co_running=False,
                num_layers=None):
        slower = 1.2 if co_running and sms < self.total_sms else 1.0
        if phase == "decode":
            return (2 + 2 * batch_size + context_tokens / 1e3) * (132 / sms) ** 0.5 * slower
        share = (num_layers or self.num_layers) / self.num_layers
        return share * (1 + 0.3 * num_tokens) * 132 / sms * slower

    def predict_mixed(self, *args, **kwargs):
        return 1e6


def test_a_served_run_reports_every_piece_in_its_timeline_and_engine_info():
    """The tiny model on the CPU: every piece a sharing option ran reaches its option's
    correction once, its timeline entry has both times, and the engine info says it."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.setup import EngineSetup
    from pdserve.sampling_params import SamplingParams

    llm = LLM("tiny", device="cpu", schedule="multiplex", max_num_batched_tokens=64,
              mux_sharing="spatial,time_slice", setup=EngineSetup(predictor=SharingModel(4)))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 150, 90, 200, 60)]
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    pieces = [e for e in llm.engine.timeline() if e["piece_launched"]]
    sharing = [e for e in pieces if e["mode"] in ("spatial", "time_slice")]
    assert sharing and all(e["measured_piece_ms"] > 0 for e in pieces)
    assert all(e["predicted_piece_ms"] > 0 and 0.5 <= e["prefill_calibration"] <= 2.0
               for e in sharing)
    learned = llm.engine.describe()["calibration"]["prefill_pieces"]
    assert sum(row["pieces"] for row in learned.values()) == len(sharing)
    # Every sharing decision names what it beat, weighed no higher than itself (or held
    # over it by the switch margin).
    beaten = [e for e in sharing if e["runner_up"]]
    assert beaten and all(e["runner_up"] != option_key(MuxMode(e["mode"]), e["decode_sms"])
                          for e in beaten)
    assert all(e["runner_up_tokens_per_s"] <= e["weighed_tokens_per_s"] or e["held_over"]
               for e in beaten)
    assert all(0.5 <= row["correction"] <= 2.0 for row in learned.values())


def test_the_planning_margins_are_flags_the_planner_uses():
    """--mux-itl-margin sets the share of the ITL target plans aim at, --mux-switch-margin
    the gain a challenger needs; both reach the planner and the engine info."""
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_itl_margin=0.95, mux_switch_margin=0.1)
    planner = llm.engine.scheduler.planner
    assert planner.config.budget_ms == pytest.approx(60.0 * 0.95)
    assert planner.config.switch_margin == 0.1
    info = llm.engine.describe()
    assert info["itl_margin"] == 0.95 and info["calibration"]["switch_margin"] == 0.1
    # As resolved: graph steps ``auto`` are off on the CPU (no captured step graphs).
    assert (info["graph_step_tokens"], info["mixed_floor_tokens"]) == (0, 256)


def test_engine_info_reports_the_graph_step_and_floor_sizes_it_plans_with():
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_mixed_floor_tokens=128)
    info = llm.engine.describe()
    assert info["mixed_floor_tokens"] == llm.engine.scheduler.planner.config.mixed_floor_tokens
    assert info["mixed_floor_tokens"] == 128


@pytest.mark.parametrize("flags, message", [({"mux_itl_margin": 1.2}, "--mux-itl-margin 1.2"),
                                            ({"mux_itl_margin": 0.0}, "--mux-itl-margin 0.0"),
                                            ({"mux_switch_margin": -0.1}, "--mux-switch-margin")])
def test_planning_margins_out_of_range_are_refused(flags, message):
    from pdserve.config import SchedulerConfig

    with pytest.raises(ValueError, match=message):
        SchedulerConfig(schedule="multiplex", **flags)


# --- how a prefill correction learns (--mux-prefill-correction) ---------------------------

MOONCAKE_DECODE = DecodeLoad(6, 6 * 10000)  # the Mooncake probe's median decode batch


def _learned(rule: str, ratio: float, base=None, pieces: int = 120) -> OnlineCalibration:
    """A model whose time-slice pieces all took ``ratio`` of their (profile) prediction."""
    base = base or SimpleNamespace(num_layers=LAYERS, total_sms=132)
    model = OnlineCalibration(base, prefill_rule=rule)
    for _ in range(pieces):
        model.observe_prefill("time_slice", 50.0, ratio * 50.0)
    return model


@pytest.mark.parametrize("ratio", [0.97, 1.19])
def test_a_converging_correction_settles_on_the_pieces_ratio(ratio):
    assert _learned("converging", ratio).prefill_correction("time_slice") == \
        pytest.approx(ratio, rel=1e-3)


@pytest.mark.parametrize("ratio, bound", [(0.97, 0.5), (1.19, 2.0)])
def test_a_compounding_correction_walks_to_its_bound_on_a_steady_ratio(ratio, bound):
    """The default rule, as the H200 timelines recorded it: pieces 3% under their
    prediction halve the factor the option's rate is divided by."""
    assert _learned("compounding", ratio).prefill_correction("time_slice") == \
        pytest.approx(bound)


def test_a_compounded_correction_hands_mixed_steps_over_to_time_slices(fitted):
    """Beside the Mooncake probe's decode batch mixed steps are predicted faster; pieces
    3% quicker than profiled make time slicing win under the compounding rule only."""
    config = MuxPlannerConfig(itl_slo_ms=ITL, max_prefill_tokens=24576, time_slice=True,
                              spatial=False)
    chosen = {}
    for rule in ("compounding", "converging"):
        model = _learned(rule, 0.97, fitted)
        plan = MuxPlanner(model, SPLITS, config).plan(MOONCAKE_DECODE, [PrefillRequest(10000)])
        chosen[rule] = plan.option
    assert chosen == {"compounding": "time_slice", "converging": "temporal"}


def test_an_unknown_prefill_rule_is_refused():
    from pdserve.config import SchedulerConfig

    with pytest.raises(ValueError, match="--mux-prefill-correction averaging"):
        SchedulerConfig(schedule="multiplex", mux_prefill_correction="averaging")
    with pytest.raises(ValueError, match="'averaging'"):
        OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132),
                          prefill_rule="averaging")


def test_the_prefill_rule_is_a_flag_the_engine_uses():
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_prefill_correction="compounding")
    assert llm.engine.scheduler.model.prefill_rule == "compounding"
    assert llm.engine.describe()["calibration"]["prefill_rule"] == "compounding"


def test_by_default_corrections_converge_and_time_slices_are_opt_in():
    """On the H200 the compounding rule walked time slices' factor to its bound and their
    batches delivered less prefill than mixed steps wherever both ran: the defaults are
    the converging rule and mixed steps beside SM splits; --mux-sharing adds time slices."""
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline")
    info = llm.engine.describe()
    assert info["calibration"]["prefill_rule"] == "converging"
    assert info["sharing"] == ["spatial", "temporal"]
    config = llm.engine.scheduler.planner.config
    assert config.temporal and config.spatial and not config.time_slice
    sliced = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
                 mux_sharing="temporal,time_slice,spatial").engine.scheduler.planner.config
    assert sliced.time_slice


# --- a median window over every correction (--mux-correction-window) ----------------------

def _windowed(window: int) -> OnlineCalibration:
    return OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132), window=window)


def _eager_steps(model: OnlineCalibration, ratios: list[float]) -> None:
    """Eager mixed steps that took ``ratios`` of the profile, each planned with the
    correction in force (as the engine reports them)."""
    for ratio in ratios:
        model.observe_mixed(40.0 * model.mixed_correction, 40.0 * ratio)


def test_a_windowed_correction_ignores_a_short_run_of_slow_steps():
    """8ccd9ac's course: ~300 eager steps near 1.03 of the profile, then three at
    1.07-1.41x. The moving rule rises to ~1.1 and stays there once the planner stops
    choosing eager steps; the window's median does not move."""
    moving, windowed = _windowed(0), _windowed(32)
    for model in (moving, windowed):
        _eager_steps(model, [1.02, 1.04] * 150 + [1.07, 1.32, 1.41])
    assert moving.mixed_correction > 1.09
    assert windowed.mixed_correction == pytest.approx(1.04, abs=1e-9)


def test_a_windowed_correction_follows_a_lasting_change_within_half_a_window():
    model = _windowed(16)
    _eager_steps(model, [1.0] * 16 + [1.3] * 7)
    assert model.mixed_correction == 1.0
    _eager_steps(model, [1.3] * 2)
    assert model.mixed_correction == pytest.approx(1.3)


def test_a_window_applies_to_decode_and_prefill_corrections_and_is_bounded():
    model = _windowed(8)
    for _ in range(8):
        model.observe_decode(20.0 * model.decode_correction, 20.0 * 0.9)
        model.observe_prefill("spatial:16", 50.0, 50.0 * 3.0)  # profile ms, as planned
    assert model.decode_correction == pytest.approx(0.9)
    assert model.prefill_correction("spatial:16") == 2.0  # the upper bound
    # Until MIN_WINDOW ratios are in, the moving rule answers.
    fresh = _windowed(8)
    fresh.observe_decode(20.0, 18.0)
    assert fresh.decode_correction == _windowed(0)._moved(1.0, 20.0, 18.0)


def test_the_correction_window_is_a_flag_the_engine_uses():
    from pdserve.config import SchedulerConfig
    from pdserve.engine.llm import LLM

    with pytest.raises(ValueError, match="--mux-correction-window -1"):
        SchedulerConfig(schedule="multiplex", mux_correction_window=-1)
    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_correction_window=32)
    assert llm.engine.scheduler.model.window == 32
    assert llm.engine.describe()["calibration"]["correction_window"] == 32


# --- guards against a correction locking a path out (--mux-stall-ratio, -half-life) -------

def _guarded(half_life: int = 0, stall_ratio: float = 0.0) -> OnlineCalibration:
    return OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132),
                             half_life=half_life, stall_ratio=stall_ratio)


def test_a_stall_teaches_no_correction():
    """6f2d50e, a fresh server (ShareGPT-like, 18 req/s): eager mixed steps of 87.9, 796.5
    and 645.5 ms where ~52 ms were predicted (kernels compiled on first use) lifted the eager
    correction 1.05 -> 1.19, at the step limit each; over 3x the prediction is a stall."""
    plain, guarded = _guarded(), _guarded(stall_ratio=3.0)
    for model in (plain, guarded):
        _eager_steps(model, [87.9 / 53.6, 796.5 / 50.8, 645.5 / 53.6])
    assert plain.mixed_correction > 1.14
    assert guarded.mixed_correction == pytest.approx(_guarded()._moved(1.0, 53.6, 87.9))
    assert guarded.describe_guards()["stalls_ignored"] == {"mixed": 2}
    guarded.observe_prefill("time_slice", 40.0, 40.0 * 3.5)  # pieces are guarded too
    assert guarded.prefill_correction("time_slice") == 1.0


def test_a_correction_not_observed_relaxes_towards_the_profile():
    model = _guarded(half_life=100)
    model.mixed_correction, model.decode_correction = 1.2, 0.8
    model.prefill_corrections["spatial:64"] = 0.5
    for _ in range(100):  # graph steps as predicted: their own factor stays learned
        model.observe_mixed(30.0 * model.graph_mixed_correction, 30.0 * 0.94, graph=True)
    assert model.mixed_correction == pytest.approx(1.2 ** 0.5)
    assert model.decode_correction == pytest.approx(0.8 ** 0.5)
    assert model.prefill_correction("spatial:64") == pytest.approx(0.5 ** 0.5)
    assert model.graph_mixed_correction == pytest.approx(0.94, rel=0.01)
    off = _guarded()
    off.mixed_correction = 1.2
    off.observe_mixed(30.0, 30.0, graph=True)
    assert off.mixed_correction == 1.2


def test_relaxing_brings_back_the_eager_steps_a_few_slow_ones_priced_out(profile_d698fcb):
    """The 6f2d50e course at 18 req/s: four eager steps at 1.4-1.5x lifted the eager
    correction to 1.2; beside ~140 decodes the planner then ran graph steps of 116 prompt
    tokens (~35 ms each) for the rest of the run. With a half-life the eager
    factor relaxes while the graph steps run, and 192-token or larger eager steps fit again.
    With the prefix pairs of a piece's first tokens fitted apart, the 192-token step fits
    the budget at 1.2, so the lock-out is planned at 1.25."""
    config = MuxPlannerConfig(itl_slo_ms=ITL, max_prefill_tokens=24576, temporal=True,
                              time_slice=False, spatial=False, graph_step_tokens=256,
                              mixed_floor_tokens=256)
    decode, waiting = DecodeLoad(140, 140 * 600), [PrefillRequest(340)] * 10
    chunks = {}
    for half_life in (0, 100):
        model = OnlineCalibration(profile_d698fcb, half_life=half_life)
        model.mixed_correction = 1.25
        plan_with = MuxPlanner(model, [], config)
        for _ in range(200):
            plan = plan_with.plan(decode, waiting)
            model.observe_mixed(plan.decode_ms, plan.decode_ms,
                                graph=plan_with.on_graphs(plan.prefill.num_tokens, 140))
        chunks[half_life] = plan.prefill.num_tokens
    assert chunks[0] == 116
    assert chunks[100] >= 192


def test_the_lock_out_guards_are_flags_the_engine_uses():
    from pdserve.config import SchedulerConfig
    from pdserve.engine.llm import LLM

    with pytest.raises(ValueError, match="--mux-stall-ratio 0.5"):
        SchedulerConfig(schedule="multiplex", mux_stall_ratio=0.5)
    with pytest.raises(ValueError, match="--mux-correction-half-life -1"):
        SchedulerConfig(schedule="multiplex", mux_correction_half_life=-1)
    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_correction_half_life=100, mux_stall_ratio=3.0)
    guards = llm.engine.describe()["calibration"]["guards"]
    assert guards == {"half_life": 100, "stall_ratio": 3.0, "stalls_ignored": {}}


# --- the delivery rule: batches, not pieces (--mux-prefill-correction delivery) ------------

def test_the_delivery_rule_converges_on_committed_over_delivered_and_ignores_pieces():
    model = OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132),
                              prefill_rule="delivery")
    for _ in range(40):
        model.observe_prefill("time_slice", 40.0, 40.0 * 1.02)  # pieces near the profile
        model.observe_delivery("time_slice", 6000.0, 6000.0 * 0.85)  # batches at 0.85
    assert model.prefill_correction("time_slice") == pytest.approx(1 / 0.85, rel=0.01)
    assert model.describe_prefill() == {
        "time_slice": {"correction": round(model.prefill_correction("time_slice"), 4),
                       "pieces": 0, "batches": 40}}
    piecewise = OnlineCalibration(SimpleNamespace(num_layers=LAYERS, total_sms=132),
                                  prefill_rule="converging")
    piecewise.observe_delivery("time_slice", 6000.0, 3000.0)  # only the delivery rule learns
    assert piecewise.prefill_correction("time_slice") == 1.0


def test_a_served_batch_teaches_the_delivery_rule_once():
    """The tiny model on the CPU: every prefill batch a sharing option started teaches its
    option once, when its last piece completes."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.setup import EngineSetup
    from pdserve.sampling_params import SamplingParams

    llm = LLM("tiny", device="cpu", schedule="multiplex", max_num_batched_tokens=64,
              mux_sharing="spatial,time_slice", mux_prefill_correction="delivery",
              setup=EngineSetup(predictor=SharingModel(4)))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 150, 90, 200, 60)]
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    first_decision: dict[int, str] = {}  # by batch: what its first piece ran as
    for e in llm.engine.timeline():
        if e["piece_launched"]:
            assert e["prefill_batch"] >= 1
            first_decision.setdefault(e["prefill_batch"], e["mode"])
    by_sharing = [mode for mode in first_decision.values() if mode in ("spatial", "time_slice")]
    learned = llm.engine.describe()["calibration"]["prefill_pieces"]
    assert by_sharing and all(row["pieces"] == 0 for row in learned.values())
    assert sum(row["batches"] for row in learned.values()) == len(by_sharing)


# --- where SM splits and time slices start (--mux-co-running-correction) -------------------

def test_co_running_options_start_from_their_correction_and_mixed_steps_from_the_profile(
        fitted):
    model = OnlineCalibration(fitted, co_running_start=1.25)
    assert [model.prefill_correction(o) for o in ("spatial:24", "time_slice", "temporal")] == [
        1.25, 1.25, 1.0]
    plans = {p.mode: p for p in planner(model, temporal=True).options(DECODE, PROMPT)}
    for mode, start in ((MuxMode.SPATIAL, 1.25), (MuxMode.TIME_SLICE, 1.25)):
        assert plans[mode].prefill_calibration == start
        assert plans[mode].weighed_tokens_per_s == pytest.approx(
            plans[mode].committed_tokens_per_s / start)
    profiled = {p.mode: p for p in planner(OnlineCalibration(fitted), temporal=True).options(
        DECODE, PROMPT)}
    assert plans[MuxMode.TEMPORAL].weighed_tokens_per_s == pytest.approx(
        profiled[MuxMode.TEMPORAL].weighed_tokens_per_s)


def test_the_co_running_start_is_what_batches_delivering_it_keep_and_relaxing_returns_to():
    base = SimpleNamespace(num_layers=LAYERS, total_sms=132)
    delivery = OnlineCalibration(base, prefill_rule="delivery", co_running_start=1.25)
    for _ in range(40):
        delivery.observe_delivery("time_slice", 6000.0, 6000.0 * 0.8)
    assert delivery.prefill_correction("time_slice") == pytest.approx(1.25, rel=0.01)
    relaxing = OnlineCalibration(base, half_life=100, co_running_start=1.25)
    relaxing.prefill_corrections["spatial:64"] = 2.0
    for _ in range(100):
        relaxing.observe_mixed(30.0 * relaxing.graph_mixed_correction, 30.0, graph=True)
    assert relaxing.prefill_correction("spatial:64") == pytest.approx(1.25 * (2.0 / 1.25) ** 0.5)


def test_the_co_running_correction_is_a_flag_the_engine_uses():
    from pdserve.config import SchedulerConfig
    from pdserve.engine.llm import LLM

    with pytest.raises(ValueError, match="--mux-co-running-correction 0.3"):
        SchedulerConfig(schedule="multiplex", mux_co_running_correction=0.3)
    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_co_running_correction=1.25)
    calibration = llm.engine.describe()["calibration"]
    assert calibration["co_running_start"] == 1.25
    assert llm.engine.scheduler.model.prefill_correction("time_slice") == 1.25


def test_each_decision_s_timeline_entry_counts_the_cuda_mallocs_its_launches_made():
    """The engine reads the allocator's segment count around every multiplex launch (a
    counter standing in for the CUDA allocator here: each read one segment more, so each
    launch made one); each decision's entry sums its launches'. Chunked prefill is not
    watched: two stats reads a launch for nothing it decides by."""
    from itertools import count

    from pdserve.engine.llm import LLM
    from pdserve.engine.setup import EngineSetup
    from pdserve.sampling_params import SamplingParams

    llm = LLM("tiny", device="cpu", schedule="multiplex", max_num_batched_tokens=64,
              mux_sharing="spatial,time_slice", setup=EngineSetup(predictor=SharingModel(4)))
    assert not llm.engine._watch_launches  # no caching allocator on the CPU
    reads = count()
    llm.engine.allocations.segments = lambda: next(reads)
    llm.engine._watch_launches = True
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 150, 90)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    entries = llm.engine.timeline()
    assert entries and all(e["cuda_mallocs"] >= 1 for e in entries)
    assert any(e["cuda_mallocs"] >= 2 for e in entries if e["piece_launched"])
    chunked = LLM("tiny", device="cpu", schedule="chunked")
    assert not chunked.engine.scheduler.watches_allocations
