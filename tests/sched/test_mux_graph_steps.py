"""Mixed steps that fit the prefill-step graphs, weighed as an option of their own
(``MuxPlannerConfig.graph_step_tokens``) at the cost such steps were measured at.

Planned with the latency model of the committed d698fcb H200 profile (codellama-34b) at an
ITL target of 60 ms beside one decode of 16K tokens: the planner's 64-token chunks plus the
decode made its mixed steps 257-449 tokens, one over the 256-token graphs, at every
prefix."""

from __future__ import annotations

import pytest

from pdserve.sched.mux_planner import (
    DecodeLoad,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)

SPLITS = [(16, 116), (24, 108), (32, 100), (48, 84), (64, 68)]
DECODE = DecodeLoad(1, 16000)


def plan_at(profile_d698fcb, prefix: int, graph_factor: float, graph_tokens: int = 256, **options):
    model = OnlineCalibration(profile_d698fcb)
    model.graph_mixed_correction = graph_factor
    config = MuxPlannerConfig(itl_slo_ms=60.0, graph_step_tokens=graph_tokens, **options)
    planner = MuxPlanner(model, SPLITS, config)
    return planner.plan(DECODE, [PrefillRequest(16000 - prefix, prefix)])


@pytest.mark.parametrize("prefix", [8000, 12000])
def test_graph_steps_measured_cheaper_are_chosen_over_a_larger_eager_step(profile_d698fcb, prefix):
    eager = plan_at(profile_d698fcb, prefix, 0.85, graph_tokens=0, spatial=False, time_slice=False)
    graph = plan_at(profile_d698fcb, prefix, 0.85, spatial=False, time_slice=False)
    assert eager.prefill.num_tokens + DECODE.batch_size > 256  # one over the graphs
    assert graph.mode == MuxMode.TEMPORAL
    assert graph.prefill.num_tokens == 256 - DECODE.batch_size
    assert "prefill-step graphs" in graph.reason
    assert graph.prefill_tokens_per_s > eager.prefill_tokens_per_s


def test_graph_steps_at_the_eager_cost_change_nothing(profile_d698fcb):
    """Until graph steps are measured cheaper, the option is weighed at the eager steps'
    cost, and the larger eager chunk keeps its higher rate."""
    for prefix in (0, 4000, 8000, 12000):
        eager = plan_at(profile_d698fcb, prefix, 1.0, graph_tokens=0)
        assert plan_at(profile_d698fcb, prefix, 1.0) == eager


def test_the_committed_rate_counts_graph_steps_through_the_whole_run(profile_d698fcb):
    """Rule 2 weighs mixed steps through a batch's worth of prompt tokens (all three options
    offered): with graph steps measured cheaper, the steps of that run take them and its
    rate rises."""
    off = plan_at(profile_d698fcb, 8000, 0.85, graph_tokens=0, time_slice=True)
    on = plan_at(profile_d698fcb, 8000, 0.85, time_slice=True)
    assert on.mode == MuxMode.TEMPORAL and on.prefill.num_tokens == 255
    assert on.committed_tokens_per_s > off.committed_tokens_per_s


def test_graph_and_eager_steps_learn_their_own_correction(profile_d698fcb):
    model = OnlineCalibration(profile_d698fcb)
    for _ in range(30):
        model.observe_mixed(40.0 * model.graph_mixed_correction, 34.0, graph=True)
    assert model.graph_mixed_correction == pytest.approx(0.85, rel=0.02)
    assert model.mixed_correction == 1.0
    args = (255, 8000, 1, 1, 16000)
    assert model.predict_graph_mixed(*args) == pytest.approx(
        model.graph_mixed_correction * profile_d698fcb.predict_mixed(*args))


def test_the_graph_step_flag_reaches_the_planner_and_bad_values_are_refused():
    from pdserve.config import SchedulerConfig
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_graph_step_tokens=256)
    assert llm.engine.scheduler.planner.config.graph_step_tokens == 256
    assert llm.engine.describe()["calibration"]["graph_mixed_steps"] == 1.0
    with pytest.raises(ValueError, match="--mux-graph-step-tokens -1"):
        SchedulerConfig(schedule="multiplex", mux_graph_step_tokens=-1)


def test_graph_steps_and_the_floor_are_on_by_default_where_graphs_are_captured():
    """Left unset, graph steps take the size of the prefill-step graphs the runner captured:
    none on the CPU, so there the planner weighs no graph steps; the floor is 256 anywhere."""
    from pdserve.config import SchedulerConfig
    from pdserve.engine.llm import LLM

    assert SchedulerConfig().mux_graph_step_tokens is None
    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline")
    assert llm.engine.config.scheduler.mux_graph_step_tokens == 0
    planner = llm.engine.scheduler.planner.config
    assert (planner.graph_step_tokens, planner.mixed_floor_tokens) == (0, 256)


@pytest.mark.parametrize("flags", [{"mux_graph_step_tokens": 1024},
                                   {"mux_graph_step_tokens": 256, "enforce_eager": True},
                                   {"mux_graph_step_tokens": 256,
                                    "piecewise_graph_max_tokens": 128}])
def test_graph_steps_larger_than_the_graphs_are_refused(flags):
    from pdserve.config import EngineConfig

    with pytest.raises(ValueError, match="--mux-graph-step-tokens .* at most"):
        EngineConfig.from_flat(schedule="multiplex", **flags)


@pytest.mark.parametrize("graph_tokens", [0, 256])
def test_a_served_run_teaches_each_kind_of_mixed_step_its_own_correction(graph_tokens):
    """The tiny model on the CPU, mixed steps only: with every step within the graph bound
    only the graph steps' correction learns, with none only the eager one (the CPU has no
    graphs: what is tested is which correction a step teaches)."""
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              max_num_batched_tokens=64, mux_sharing="temporal",
              mux_graph_step_tokens=graph_tokens)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 150, 90, 200)]
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert any(e["mode"] == "temporal" and e["decode_batch"] for e in llm.engine.timeline())
    learned = llm.engine.describe()["calibration"]
    moved, kept = ("graph_mixed_steps", "mixed_steps") if graph_tokens else \
        ("mixed_steps", "graph_mixed_steps")
    assert learned[moved] != 1.0 and learned[kept] == 1.0
