"""The opt-in compiled simulator (setup.py with ``PDSERVE_COMPILE_SIM=1``: mypyc over the
same source) built for real, and short simulations run by it and by the interpreted
modules: every figure the same."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Three fleets (the dynamic ratio; one pool by round-robin; PD-multiplexing instances),
# each run for a simulated minute; the summaries and the ratio's moves, as JSON.
RUNS = """
import json
import numpy as np
from pdserve.cluster.config import RatioConfig
from pdserve.sim import compiled
from pdserve.sim.cluster import LatencyModel, Multiplexing
from pdserve.sim.fleet import FleetSim, Lengths, plan_fleet

model = LatencyModel(1e-4, 1e-9, 0.015, 1e-4, 1e-7, kv_bytes_per_token=1000,
                     link_gb_per_s=1.0, decode_kv_tokens=20_000)
lengths = Lengths(np.array([200, 1000, 3000, 500]), np.array([20, 50, 5, 100]))
plan = plan_fleet(model, lengths, num_instances=60, num_scenarios=6, period_s=120.0)
# Too few prefill instances at first, more load than they take: the ratio moves some.
short = plan_fleet(model, lengths, num_instances=60, num_scenarios=6, period_s=120.0,
                   peak_load=1.2, prefill_share=0.3)
fleets = [FleetSim(short, model, lengths, num_gateways=3, ratio=RatioConfig()),
          FleetSim(plan, model, lengths, dispatch="round-robin", pooled=True, seed=1),
          FleetSim(plan, model, lengths, multiplexing=Multiplexing(1.5, 2.0), seed=2)]
runs = [{"summary": f.run(60.0),
         "moves": [m for g in f.distinct_groups() for m in g.moves]} for f in fleets]
print(json.dumps({"compiled": compiled(), "runs": runs}))
"""


def _toolchain_missing() -> str | None:
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (pip install mypy)"
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        return "no C compiler (gcc) to build the compiled simulator with"
    return None


def _copy(to: Path) -> Path:
    """The package's source alone (no build left in the checkout), with what setup.py reads."""
    shutil.copytree(ROOT / "pdserve", to / "pdserve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, to / name)
    return to


def _start_runs(where: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.Popen([sys.executable, "-c", RUNS], cwd=where, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _runs_of(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err
    return json.loads(out)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compiled_simulator_gives_the_interpreted_figures(tmp_path):
    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(missing)
    built = _copy(tmp_path / "compiled")
    # The interpreted copy runs while the compiled one builds (the build takes one core).
    interpreting = _start_runs(_copy(tmp_path / "interpreted"))
    try:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=built,
                       check=True, env={**os.environ, "PDSERVE_COMPILE_SIM": "1"},
                       capture_output=True)
        compiled, interpreted = _runs_of(_start_runs(built)), _runs_of(interpreting)
    finally:
        if interpreting.poll() is None:  # the build failed: not left running
            interpreting.kill()
            interpreting.wait()
    assert compiled["compiled"] is True and interpreted["compiled"] is False
    assert compiled["runs"][0]["summary"]["requests"] > 1000
    assert compiled["runs"][0]["moves"]  # the ratio controller's path ran
    assert compiled["runs"] == interpreted["runs"]
