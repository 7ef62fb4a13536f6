"""``--mux-mixed-floor-cap``: the server flag of the mixed floor's cap on a step."""

from __future__ import annotations

import pytest

from pdserve.config import SchedulerConfig
from pdserve.sched.multiplex import mux_planner_config


def test_the_flag_reaches_the_planner():
    assert mux_planner_config(SchedulerConfig()).mixed_floor_cap == 1.25
    sched = SchedulerConfig(mux_mixed_floor_tokens=512, mux_mixed_floor_cap=1.0)
    assert mux_planner_config(sched).mixed_floor_cap == 1.0


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan"), float("inf")])
def test_a_cap_that_admits_no_step_or_every_step_is_refused(cap):
    with pytest.raises(ValueError, match="--mux-mixed-floor-cap"):
        SchedulerConfig(mux_mixed_floor_cap=cap)


def test_the_engine_reports_the_cap():
    from pdserve.engine.llm import LLM

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              mux_mixed_floor_cap=1.0)
    assert llm.engine.describe()["mixed_floor_cap"] == 1.0
