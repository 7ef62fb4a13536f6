"""benchmarks/mux_calibration_audit.py: the update rule it reads off recorded corrections,
and the decode load it rebuilds from per-request records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.config import PIECE_RULES
from pdserve.sched.mux_planner import OnlineCalibration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("mux_calibration_audit",
                                                  BENCHMARKS / "mux_calibration_audit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mux_calibration_audit"] = module
    spec.loader.exec_module(module)
    return module


def _recorded(rule: str) -> list[dict]:
    """Time-slice decisions as a timeline records them: the correction each was planned
    with, then its piece's predicted and measured time (learned before the next one)."""
    model = OnlineCalibration(SimpleNamespace(num_layers=48, total_sms=132), prefill_rule=rule)
    entries = []
    for i in range(40):
        measured = 50.0 * (0.8 + 0.025 * (i % 5))  # 0.8-0.9 of the prediction
        entries.append({"mode": "time_slice", "decode_sms": 132, "piece_launched": True,
                        "prefill_calibration": model.prefill_correction("time_slice"),
                        "predicted_piece_ms": 50.0, "measured_piece_ms": measured})
        model.observe_prefill("time_slice", 50.0, measured)
    return entries


@pytest.mark.parametrize("rule", PIECE_RULES)
def test_the_update_rule_is_read_off_the_recorded_corrections(audit, rule):
    found = audit.prefill_corrections(_recorded(rule))["time_slice"]["update_rule"]
    other = next(r for r in PIECE_RULES if r != rule)
    assert found["steps_checked"] > 10
    assert found[f"match_{rule}"] == found["steps_checked"]
    assert found[f"match_{other}"] < found["steps_checked"] / 4


def test_decode_load_and_prefill_windows_from_request_records(audit):
    record = {"samples": [
        {"success": True, "send_s": 0.0, "ttft_ms": 1000.0, "e2e_ms": 11000.0,
         "prompt_len": 4000, "output_tokens": 100},
        {"success": True, "send_s": 0.5, "ttft_ms": 1500.0, "e2e_ms": 5500.0,
         "prompt_len": 2000, "output_tokens": 40},
        {"success": False, "send_s": 0.6, "ttft_ms": 0.0, "e2e_ms": 0.0,
         "prompt_len": 9, "output_tokens": 0}]}
    spans = audit.spans_of(record)
    assert [start for _, start in audit.prefill_windows(spans)] == [0.0, 1.0]
    load = audit.decode_load_at(spans, 3.0)  # both decode: 20% and 25% through
    assert (load.batch_size, load.context_tokens) == (2, 4000 + 20 + 2000 + 10)
    states = audit.decode_states(spans)
    assert [s["decode_batch"] for s in states] == [0, 1]  # the second: beside the first
    assert states[1]["measured_tokens_per_s"] == 2000


def test_a_mixed_step_is_set_against_its_uncorrected_prediction(audit):
    entry = {"mode": "temporal", "time": 1.0, "decode_sms": 132, "decode_batch": 1,
             "prefill_tokens": 256, "prefill_context_tokens": 0,
             "predicted_decode_ms": 55.0, "calibration": 1.1, "measured_cycle_ms": 60.0,
             "measured_device_ms": 52.0}
    predictor = SimpleNamespace(predict_mixed=lambda *args, **kw: 50.0, total_sms=132)
    [step] = audit.mixed_steps([entry], predictor)
    assert step["ratio"] == pytest.approx(52.0 / 50.0)  # the device's clock, as learned


def test_the_rules_replayed_over_steady_pieces_walk_or_settle(audit):
    # Pieces steadily at 0.9 of the profile: the compounding factor walks to its 0.5 bound
    # and weighs the late pieces at ~1.8x what they deliver; the converging one settles.
    replayed = audit.replay_rules([(100.0, 90.0)] * 60, start=1.0)
    compounding, converging = replayed["compounding"], replayed["converging"]
    assert compounding["last"] == 0.5
    assert converging["last"] == pytest.approx(0.9, rel=1e-3)
    assert compounding["measured_over_corrected"]["p90"] > 1.7
    assert converging["measured_over_corrected"]["p50"] == pytest.approx(1.0, abs=0.01)
    assert converging["pieces_10pct_off"] <= 1 < 40 < compounding["pieces_10pct_off"]
    # From an inherited factor the replay starts where the run did.
    assert audit.replay_rules([(100.0, 100.0)], start=2.0)["converging"][
        "measured_over_corrected"]["p50"] == 0.5


def test_the_rules_are_totalled_over_every_option_of_every_timeline(audit):
    steady = audit.replay_rules([(100.0, 90.0)] * 60, start=1.0)
    single = audit.replay_rules([(100.0, 100.0)], start=1.0)
    timelines = {"a": {"prefill_corrections": {"time_slice": {"rules_replayed": steady}}},
                 "b": {"prefill_corrections": {"spatial:16": {"rules_replayed": single},
                                               "spatial:24": {"rules_replayed": steady}}}}
    totals = audit.rules_overall(timelines)
    assert totals["converging"]["pieces"] == totals["compounding"]["pieces"] == 121
    assert totals["compounding"]["pieces_10pct_off"] == \
        2 * steady["compounding"]["pieces_10pct_off"]


def test_the_eager_window_replay_holds_where_the_moving_rule_rose(audit):
    # Recorded eager steps (384 tokens > the graph steps' 256), each with the correction
    # it was planned with: 30 near the profile, then three slow ones.
    ratios = [1.03] * 30 + [1.07, 1.32, 1.41]
    entries, correction = [], 1.03
    for ratio in ratios:
        entries.append({"mode": "temporal", "prefill_tokens": 384, "decode_batch": 8,
                        "predicted_cycle_ms": 50.0 * correction, "calibration": correction,
                        "measured_device_ms": 50.0 * ratio})
    replay = audit.eager_window_replay(entries, 1.03, [0, 16], graph_step_tokens=256)
    assert replay["eager_steps"] == 33
    assert replay["window_0"]["last"] > 1.09
    assert replay["window_16"] == {"max": 1.03, "last": 1.03}


def _mixed_entry(t: float, predicted: float, measured: float) -> dict:
    return {"time": t, "mode": "temporal", "prefill_tokens": 384, "decode_batch": 8,
            "predicted_cycle_ms": predicted, "calibration": 1.0,
            "measured_device_ms": measured, "measured_cycle_ms": measured}


def test_the_stall_census_lists_stalls_and_counts_slow_rates(audit):
    entries = [_mixed_entry(100.0 + i * 0.05, 50.0, 50.0) for i in range(20)]
    entries[3]["measured_device_ms"] = 800.0  # 16x: kernels compiled on first use
    entries[9]["measured_device_ms"] = 90.0  # 1.8x: slow, but a rate
    entries.append({"time": 102.0, "mode": "time_slice", "decode_sms": 132,
                    "piece_launched": True, "prefill_calibration": 2.0,
                    "predicted_piece_ms": 40.0, "measured_piece_ms": 200.0})  # 2.5x corrected
    census = audit.stall_census(entries, 3.0)
    assert census["mixed"] == {"observed": 20, "between_1.5x_and_ratio": 1,
                               "stalls": [{"t_s": 0.15, "ratio": 16.0}]}
    assert census["piece"] == {"observed": 1, "between_1.5x_and_ratio": 1, "stalls": []}


def test_the_guarded_eager_replay_skips_the_stalls(audit):
    entries = [_mixed_entry(float(i), 50.0, m) for i, m in enumerate([52.0, 800.0, 650.0, 51.0])]
    replay = audit.eager_window_replay(entries, 1.0, [0], graph_step_tokens=256,
                                       stall_ratio=3.0)
    assert replay["window_0"]["last"] > replay["window_0_stall_3"]["last"] > 1.0
    assert replay["window_0_stall_3"]["last"] < 1.02
