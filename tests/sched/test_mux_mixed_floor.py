"""The mixed-step floor (``MuxPlannerConfig.mixed_floor_tokens``): a mixed step keeps at
least that many prompt tokens where the per-step budget would cut its chunk smaller, within
a cap on the step.

Planned with the latency model of the committed d698fcb H200 profile (codellama-34b) at an
ITL target of 60 ms beside the Mooncake probe's median decode batch (5 requests of ~11K
tokens): over a 20K-token prefix the budget (54 ms) leaves the planner 64-192-token chunks,
which the e0559f6 timelines measured at 1.2-3.8K prompt tokens/s."""

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
DECODE = DecodeLoad(5, 5 * 11000)
PROMPT = 24000


def mixed_plan(profile_d698fcb, prefix: int, floor: int, graph_tokens: int = 0, cap: float = 1.25,
               correction: float = 1.0, **options):
    model = OnlineCalibration(profile_d698fcb)
    model.mixed_correction = model.graph_mixed_correction = correction
    config = MuxPlannerConfig(itl_slo_ms=60.0, graph_step_tokens=graph_tokens,
                              mixed_floor_tokens=floor, mixed_floor_cap=cap,
                              **{"spatial": False, "time_slice": False, **options})
    planner = MuxPlanner(model, SPLITS, config)
    return planner.plan(DECODE, [PrefillRequest(PROMPT - prefix, prefix)])


def test_over_a_long_prefix_the_budget_cuts_the_chunk_small(profile_d698fcb):
    plan = mixed_plan(profile_d698fcb, 20000, floor=0)
    assert plan.mode == MuxMode.TEMPORAL
    assert plan.prefill.num_tokens < 256
    assert plan.cycle_ms <= 54.0


def test_the_floor_keeps_the_chunk_within_its_cap(profile_d698fcb):
    plan = mixed_plan(profile_d698fcb, 20000, floor=256)
    assert plan.mode == MuxMode.TEMPORAL and plan.meets_slo
    assert plan.prefill.num_tokens == 256
    assert 54.0 < plan.cycle_ms <= 60.0 * 1.25
    assert "the floor, over the budget" in plan.reason
    assert plan.prefill_tokens_per_s > mixed_plan(profile_d698fcb, 20000, 0).prefill_tokens_per_s


def test_a_floor_step_over_the_cap_is_not_taken(profile_d698fcb):
    plan = mixed_plan(profile_d698fcb, 20000, floor=256, cap=0.95)
    assert plan == mixed_plan(profile_d698fcb, 20000, floor=0)


def test_where_the_floor_is_over_the_cap_the_largest_chunk_within_it_is_taken(profile_d698fcb):
    """At a correction of 1.3 over a 22K prefix, 256 tokens are over 75 ms, 192 within it,
    and the budget fits 64 (a short piece's pairs over a long prefix cost more each than a
    long piece's, and the fit prices them apart): the step takes 192 rather than falling
    back to the budget's chunk (a floor of 320 fell back to small chunks in the replay,
    2.5K tokens/s)."""
    budget = mixed_plan(profile_d698fcb, 22000, floor=0, correction=1.3)
    floored = mixed_plan(profile_d698fcb, 22000, floor=256, correction=1.3)
    assert budget.prefill.num_tokens == 64
    assert floored.prefill.num_tokens == 192
    assert budget.cycle_ms <= 54.0 < floored.cycle_ms <= 75.0


def test_where_a_larger_chunk_fits_the_floor_changes_nothing(profile_d698fcb):
    for prefix in (0, 2000, 6000):
        assert mixed_plan(profile_d698fcb, prefix, 256) == mixed_plan(profile_d698fcb, prefix, 0)


def test_with_graph_steps_the_floor_stays_on_the_graphs(profile_d698fcb):
    plan = mixed_plan(profile_d698fcb, 20000, floor=256, graph_tokens=256)
    assert plan.prefill.num_tokens == 256 - DECODE.batch_size
    assert "prefill-step graphs" in plan.reason


def test_the_floor_lifts_mixed_steps_out_of_a_raised_correction(profile_d698fcb):
    """Small steps' high measured cost raised the one mixed correction (to 1.55-1.79 in the
    e0559f6 Mooncake runs); at 1.7 the budget fits only small chunks even over a short
    prefix, which keeps the correction up. The floor's step is weighed by the same inflated
    prediction and still taken within the cap."""
    raised = mixed_plan(profile_d698fcb, 4000, floor=0, correction=1.7)
    floored = mixed_plan(profile_d698fcb, 4000, floor=256, correction=1.7)
    assert raised.prefill.num_tokens <= 128
    assert floored.prefill.num_tokens == 256


def test_the_committed_rate_of_mixed_steps_counts_the_floor(profile_d698fcb):
    """Rule 2 weighs mixed steps through the prompt tokens another option's batch would
    take (time slicing offered here): with the floor, the steps over the long prefix keep
    their chunk, and the rate mixed steps are weighed by rises."""
    off = mixed_plan(profile_d698fcb, 14000, floor=0, time_slice=True)
    on = mixed_plan(profile_d698fcb, 14000, floor=256, time_slice=True)
    assert off.mode == on.mode == MuxMode.TEMPORAL
    assert off.prefill.num_tokens < 256 == on.prefill.num_tokens
    assert on.committed_tokens_per_s > off.committed_tokens_per_s


def test_the_floor_flag_reaches_the_planner_and_bad_values_are_refused():
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_mixed_floor_tokens=256)
    assert llm.engine.scheduler.planner.config.mixed_floor_tokens == 256
    with pytest.raises(ValueError, match="--mux-mixed-floor-tokens -1"):
        SchedulerConfig(schedule="multiplex", mux_mixed_floor_tokens=-1)


class SteepMixedModel:
    """A GPU whose mixed steps cost 10 ms plus 0.5 ms a prompt token (the 54 ms budget fits
    64-token chunks, 1.25x the 60 ms target 128), for the tiny model on the CPU."""

    total_sms, num_layers = 132, 4

    def predict(self, phase, num_tokens, context_tokens, batch_size, sms, co_running=False,
                num_layers=None):
        share = (num_layers or self.num_layers) / self.num_layers
        return 5.0 if phase == "decode" else share * (1 + 0.1 * num_tokens)

    def predict_mixed(self, prefill_tokens, *args, **kwargs):
        return 10.0 + 0.5 * prefill_tokens


@pytest.mark.parametrize("floor, first_chunk", [(0, 64), (128, 128)])
def test_a_served_run_takes_the_floor_chunk_beside_decode(floor, first_chunk):
    """The engine runs the planner's floor chunk as it is: the first mixed step beside the
    first decode carries it (later steps follow the CPU's measured times)."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.setup import EngineSetup
    from pdserve.sampling_params import SamplingParams

    llm = LLM("tiny", device="cpu", schedule="multiplex", max_num_batched_tokens=256,
              mux_sharing="temporal", mux_mixed_floor_tokens=floor,
              setup=EngineSetup(predictor=SteepMixedModel()))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (200, 300, 300)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    mixed = [e for e in llm.engine.timeline() if e["mode"] == "temporal"]
    assert mixed and mixed[0]["prefill_tokens"] == first_chunk


def _sharegpt_chunk(profile_d698fcb, correction: float, off_graphs: bool) -> tuple[int, float]:
    """ShareGPT-like at 16 req/s: ~140 decodes, ~340-token prompts waiting, graph steps to
    256 rows, the eager correction as a fresh H200 server learned it."""
    model = OnlineCalibration(profile_d698fcb)
    model.mixed_correction = correction
    config = MuxPlannerConfig(itl_slo_ms=60.0, max_prefill_tokens=24576, spatial=False,
                              time_slice=False, graph_step_tokens=256, mixed_floor_tokens=256,
                              floor_off_graphs=off_graphs)
    plan = MuxPlanner(model, [], config).plan(DecodeLoad(140, 140 * 600),
                                              [PrefillRequest(340)] * 10)
    return plan.prefill.num_tokens, plan.prefill_tokens_per_s


def test_off_the_graphs_an_eager_correction_of_1_25_keeps_the_whole_floor(profile_d698fcb):
    # The floor cut to the graphs' room (256 - 140 decodes) is a 116-token graph step, the
    # planner's once the eager correction prices 192-token steps over the budget (from 1.25
    # with the prefix pairs of a piece's first tokens fitted apart; 1.2 before). Measured:
    # half the prefill rate.
    fitting = _sharegpt_chunk(profile_d698fcb, 1.0, False)
    assert fitting[0] >= 256
    cut, cut_rate = _sharegpt_chunk(profile_d698fcb, 1.25, False)
    whole, whole_rate = _sharegpt_chunk(profile_d698fcb, 1.25, True)
    assert cut == 116 and whole == 256
    assert whole_rate > 1.3 * cut_rate
    assert _sharegpt_chunk(profile_d698fcb, 1.6, True)[0] == 116  # over the cap: the graphs
    assert _sharegpt_chunk(profile_d698fcb, 1.0, True) == fitting  # fitting: nothing changes


def test_the_floor_off_the_graphs_is_a_flag_the_planner_gets():
    from pdserve.sched.multiplex import mux_planner_config

    sched = SchedulerConfig(schedule="multiplex", mux_floor_off_graphs=True)
    assert mux_planner_config(sched).floor_off_graphs
    assert not mux_planner_config(SchedulerConfig(schedule="multiplex")).floor_off_graphs


def test_with_aligned_steps_the_floor_is_rounded_down_to_an_aligned_step(profile_d698fcb):
    """A 256-token floor beside 5 decodes: a 251-token chunk, a 256-token step."""
    plan = mixed_plan(profile_d698fcb, 20000, floor=256, align_step_tokens=True)
    assert plan.mode == MuxMode.TEMPORAL
    assert plan.prefill.num_tokens + DECODE.batch_size == 256
    with_graphs = mixed_plan(profile_d698fcb, 2000, floor=256, graph_tokens=512,
                             align_step_tokens=True)
    assert (with_graphs.prefill.num_tokens + DECODE.batch_size) % 64 == 0


def test_with_aligned_steps_a_large_decode_batch_keeps_most_of_the_floor(profile_d698fcb):
    """Beside 150 decodes the 256-token floor's step of 406 tokens is rounded down to 384:
    a 234-token chunk (the floor stays prompt tokens, not the step's)."""
    model = OnlineCalibration(profile_d698fcb)
    config = MuxPlannerConfig(itl_slo_ms=60.0, mixed_floor_tokens=256, spatial=False,
                              time_slice=False, align_step_tokens=True)
    planner = MuxPlanner(model, SPLITS, config)
    assert planner._floor_chunk(DecodeLoad(150, 150 * 1000), PROMPT) == 234
