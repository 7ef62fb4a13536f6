"""Records keep their meaning when the multiplex defaults change: ``ran_explicitly`` names
what a command line left to the defaults, as the engine reported running it or as the
defaults were then."""

from __future__ import annotations

import shlex

import pytest

from pdserve.config import SchedulerConfig, ran_explicitly
from pdserve.sim.mux_steps import scheduler_config


def test_a_record_without_the_planner_flags_replays_with_the_defaults_it_ran():
    ran = ran_explicitly("--schedule multiplex --itl-slo-ms 60")
    sched = scheduler_config(ran)
    assert sched.mux_tpot_bank_cap == 0.0 and sched.tpot_bank_quantile() == 0.0
    assert sched.ttft_pressed_margin() == 0.0
    assert sched.mux_co_running_correction == 1.0
    assert sched.mux_reweigh_spatial_batches is False
    assert (sched.mux_sharing, sched.mux_prefill_correction) == (
        "temporal,time_slice,spatial", "compounding")


def test_what_the_engine_reported_wins_over_the_earlier_defaults():
    engine = {"sharing": ["spatial", "temporal"], "tpot_bank_cap": 2.0,
              "tpot_bank_quantile": 0.05, "ttft_pressed_margin": 1.05,
              "reweigh_spatial_batches": True,
              "calibration": {"co_running_start": 1.3, "prefill_rule": "converging"}}
    ran = ran_explicitly("--schedule multiplex --ttft-slo-ms 5000", engine)
    sched = scheduler_config(ran)
    assert (sched.mux_tpot_bank_cap, sched.mux_tpot_bank_quantile) == (2.0, 0.05)
    assert sched.ttft_pressed_margin() == 1.05
    assert (sched.mux_co_running_correction, sched.mux_reweigh_spatial_batches) == (1.3, True)


def test_flags_a_command_line_names_are_left_as_named():
    args = ("--schedule multiplex --no-mux-reweigh-spatial-batches --mux-tpot-bank-cap 1.2 "
            "--mux-co-running-correction=1.1")
    ran = ran_explicitly(args)
    assert shlex.split(ran).count("--mux-tpot-bank-cap") == 1
    assert "--mux-reweigh-spatial-batches" not in shlex.split(ran)
    sched = scheduler_config(ran)
    assert (sched.mux_tpot_bank_cap, sched.mux_co_running_correction) == (1.2, 1.1)
    assert sched.mux_reweigh_spatial_batches is False
    assert ran_explicitly(ran) == ran  # naming twice changes nothing


def test_the_defaults_are_the_configuration_measured_best():
    sched = SchedulerConfig(ttft_slo_ms=5000.0)
    assert (sched.mux_tpot_bank_cap, sched.tpot_bank_quantile()) == (2.0, 0.05)
    assert (sched.mux_co_running_correction, sched.mux_reweigh_spatial_batches) == (1.3, True)
    assert sched.ttft_pressed_margin() == 1.05 and sched.tpot_bank_quantile() == 0.05


def test_the_bank_off_takes_its_quantile_with_it_unless_one_is_named():
    assert SchedulerConfig(mux_tpot_bank_cap=0.0).tpot_bank_quantile() == 0.0
    with pytest.raises(ValueError, match="needs --mux-tpot-bank-cap"):
        SchedulerConfig(mux_tpot_bank_cap=0.0, mux_tpot_bank_quantile=0.05)
