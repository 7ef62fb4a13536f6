"""benchmarks/mux_mixed_floor_replay.py: the factors it reads off a timeline and the walk
that holds the planner to them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.sched.mux_planner import DecodeLoad
from pdserve.sched.predictor import LatencyPredictor

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "benchmarks/results/loogle_h200/d698fcb_predictor.json"


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location(
        "mux_mixed_floor_replay", ROOT / "benchmarks/mux_mixed_floor_replay.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mux_mixed_floor_replay"] = module
    spec.loader.exec_module(module)
    return module


def _step(tokens: int, batch: int, predicted: float, measured: float, calibration: float):
    return {"mode": "temporal", "prefill_tokens": tokens, "decode_batch": batch,
            "predicted_cycle_ms": predicted, "measured_device_ms": measured,
            "calibration": calibration}


def test_eager_factors_are_measured_over_the_uncorrected_prediction(replay):
    # planned at a correction of 1.5: the profile said 30 ms, the step took 54
    steps = [_step(64, 300, 45.0, 54.0, 1.5)] * 3 + [_step(320, 5, 50.0, 50.0, 1.0)]
    factors = replay.measured_factors([steps], [False])
    assert factors[False, 64] == (pytest.approx(1.8), 3)
    assert factors[False, 320] == (pytest.approx(1.0), 1)
    assert replay.truth_factor(factors, 128, 300) == pytest.approx(1.8)  # nearest: 64


def test_the_floor_keeps_small_steps_out_where_one_factor_learns_from_them(replay):
    """Steps of at most 128 tokens measured at 1.8x the profile, larger ones at 1.0: with
    graph steps and a decode batch of 8, the one graph factor climbs on the small steps
    until only they fit; the floor keeps the 248-token steps."""
    factors = {(True, 64): (1.8, 1), (True, 128): (1.8, 1), (True, 192): (1.0, 1),
               (False, 256): (1.0, 1), (False, 384): (1.0, 1)}
    predictor = LatencyPredictor.load(PROFILE)
    decode = DecodeLoad(8, 8 * 11000)
    prompts = [24000] * 6
    walk = lambda **v: replay.walk(predictor, factors, prompts, decode, 60.0,
                                   replay.Variant(graph_step_tokens=256, **v))
    plain, floored = walk(), walk(mixed_floor_tokens=256)
    assert plain["share_of_time_in_chunks_up_to_128"] > 0.3
    assert floored["share_of_time_in_chunks_up_to_128"] < 0.05
    assert floored["prefill_tokens_per_s"] > 1.3 * plain["prefill_tokens_per_s"]
