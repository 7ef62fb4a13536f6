"""The multiplexing instance's planner model as the validation builds it: the planner's
walk times each piece as measured (not by the correction it chose with), and the factor
of the plan an instance delivered is fitted by replaying its probe on the instance model."""

from __future__ import annotations

import importlib
import itertools
from argparse import Namespace
from pathlib import Path

import pytest

from pdserve.sched.mux_planner import DecodeLoad
from pdserve.sched.predictor import LatencyPredictor
from pdserve.sim.cluster import LatencyModel, PlannerShare

ROOT = Path(__file__).resolve().parents[2]
PREDICTOR = ROOT / "benchmarks" / "results" / "loogle_h200" / "d698fcb_predictor.json"
# 1 ms per prompt token; decode 10 ms a step whatever the batch.
MODEL = LatencyModel(1e-3, 0.0, 0.01, 0.0, 0.0, kv_bytes_per_token=1_000_000)
AXES = {"batches": (1.0, 16.0), "contexts": (100.0, 8000.0), "prompts": (100.0, 8000.0)}


def _script(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def test_the_walk_times_pieces_as_measured_and_chooses_by_the_correction():
    """A time-slice correction at the engine's floor (0.5) makes the planner choose time
    slices as before; timed by it, the walk finishes the prompt in half the time it takes
    when its pieces are timed as measured (1.0 here)."""
    whatif = _script("mux_whatif")
    predictor = LatencyPredictor.load(PREDICTOR)
    settings = whatif.PlannerSettings(itl_ms=60.0, sharing=("time_slice",),
                                      prefill_corrections={"time_slice": 0.5})
    load = DecodeLoad(8, 8 * 4000)
    by_correction = whatif.walk_prompt(settings.planner(predictor), 8192, load)
    as_measured = whatif.walk_prompt(settings.planner(predictor), 8192, load,
                                     {"time_slice": 1.0})
    assert by_correction["decisions_by_mode"] == as_measured["decisions_by_mode"]
    assert set(as_measured["decisions_by_mode"]) == {"time_slice"}
    assert by_correction["prefill_tokens_per_s"] == pytest.approx(
        2.0 * as_measured["prefill_tokens_per_s"])
    timed = whatif.replace(settings, piece_timing={"time_slice": 1.0})
    assert whatif.PlannedShare(predictor, timed).factors(8, 8 * 4000, 8192)[0] == \
        pytest.approx(2.0 * whatif.PlannedShare(predictor, settings).factors(8, 8 * 4000, 8192)[0])


def _share(factor: float) -> PlannerShare:
    points = list(itertools.product(*AXES.values()))
    return PlannerShare(**AXES, prefill=(factor,) * len(points), decode=(1.5,) * len(points))


def _args() -> Namespace:
    # Decode streams that outlast the probe's prompts, as the probe checks they do.
    return Namespace(mix_batch=4, mix_prompt=2000, mix_warmup_s=0.5, mix_steps=2000,
                     mix_queue=4, decode_contexts=[1000, 1000])


def test_the_probe_fit_brings_the_probe_back_with_the_decode_streams_prompts_in_it():
    """A queue probe made on the model with 1.7 of the plan delivered: the fit finds 1.7.
    The decode streams' own prompts (4 x 1000 tokens, 4 s alone at 1.5 of it beside decode)
    are still prefilling when the probe's arrive at 0.5 s: the closed form, which puts the
    whole time on the probe's prompts, finds more."""
    module = _script("sim_validate_instance")
    args, share = _args(), _share(1.5)
    probe = {"prompts": 4, "decode_context": 1000}
    steps = args.mix_steps * (1 + args.mix_queue // 2)
    measured = module.simulated_mux_probe_s(
        MODEL, module.dataclasses.replace(share, delivered=1.7), args, probe, steps)
    interference = {"queue": {**probe, "prompt_s": measured}}
    assert module.fit_probe_delivered(share, interference, MODEL, args) == pytest.approx(
        1.7, rel=1e-4)
    closed_form = measured / (4 * MODEL.prefill_s(2000) * 1.5)
    assert closed_form > 1.7 * 1.3


def test_the_probe_fit_stops_with_the_reason_outside_its_range():
    module = _script("sim_validate_instance")
    args = _args()
    interference = {"prompts": 1, "decode_context": 1000, "prompt_s": 1e-3}
    with pytest.raises(SystemExit, match="no factor from"):
        module.fit_probe_delivered(_share(1.5), interference, MODEL, args)
    assert module.solve_rising(lambda x: x * x, 4.0, 0.1, 10.0) == pytest.approx(2.0, 1e-5)


def test_one_option_delivers_what_the_probes_saw_it_deliver_or_stops():
    module = _script("sim_validate_instance")
    interference = {"timeline_probes": {"prefill_delivery": {
        "time_slice": {"realized_over_committed": 0.8}}}}
    assert module.option_delivered(interference, "time_slice") == pytest.approx(1.25)
    with pytest.raises(SystemExit, match="the probes ran no temporal"):
        module.option_delivered(interference, "temporal")
    with pytest.raises(SystemExit, match="the probes ran no temporal"):
        module.option_delivered({}, "temporal")
