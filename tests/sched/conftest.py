from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.sched.predictor import LatencyPredictor

ROWS_6F90BE1 = (Path(__file__).parent.parent / "data"
                / "h200_codellama34b_profile_rows_6f90be1.json")
PREDICTOR_D698FCB = (Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                     / "loogle_h200" / "d698fcb_predictor.json")


@pytest.fixture(scope="session")
def fitted_6f90be1() -> LatencyPredictor:
    """The latency model fitted on the committed H200 profile rows of the 6f90be1 run
    (codellama-34b, 132 SMs, splits of 16 / 24 / 32 / 48 / 64 decode SMs)."""
    data = json.loads(ROWS_6F90BE1.read_text())
    return LatencyPredictor.fit(data["rows"], gpu_name=data["gpu"], model_name=data["model"],
                                num_layers=data["num_layers"], total_sms=data["total_sms"])


@pytest.fixture(scope="session")
def profile_d698fcb() -> LatencyPredictor:
    """The committed predictor of the d698fcb H200 run (codellama-34b, splits of 16 / 24 /
    32 / 48 / 64 decode SMs of 132), as the goodput probes serve with it."""
    return LatencyPredictor.load(PREDICTOR_D698FCB)
