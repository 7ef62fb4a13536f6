"""The chunked instance's mixed step fitted on a measured grid of mixed steps
(``fit_mixed_step_grid``): known coefficients recovered from synthetic steps, the roofline
form kept where the grid terms are zero, and the fit on the committed H200 grid."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.sim.cluster import LatencyModel
from pdserve.sim.instance import (
    fit_mixed_step_grid,
    grid_case_kernels_s,
    grid_case_s,
    mixed_step_s,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GRID = RESULTS / "mixed_step_grid_h200_d92d053.json"
BASE = LatencyModel(1e-4, 2.5e-9, 0.017, 3e-5, 4.4e-8, kv_bytes_per_token=1)
TRUE = dataclasses.replace(BASE, mixed_prefix_floor_per_token_s=1.3e-6,
                           mixed_prefix_per_pair_s=4e-9, mixed_graph_max_tokens=256,
                           mixed_graph_extra_s=0.0025, mixed_eager_extra_s=0.001,
                           mixed_eager_floor_s=0.03)
GRID_TERMS = [f.name for f in dataclasses.fields(LatencyModel) if f.name.startswith("mixed_")]


def synthetic_grid(model: LatencyModel) -> dict:
    """Steps as ``bench_mixed_step.py --grid`` records them, timed exactly by ``model``: the
    kernels as it models them plus its extra on the step's path, the eager step never under
    its floor, the graph step 3 ms over its kernels."""
    cases = []
    for tokens in (64, 128, 256, 384, 512, 1024):
        for prefix in (0, 4096, 16384):
            for decodes in (1, 8, 32):
                case = {"prefill_tokens": tokens, "prefix": prefix, "decodes": decodes,
                        "decode_context": 4096}
                extra = model.mixed_graph_extra_s if tokens + decodes <= 256 \
                    else model.mixed_eager_extra_s
                kernel_s = grid_case_kernels_s(model, case) + extra
                cases.append({**case, "kernel_sum_ms": kernel_s * 1e3,
                              "eager_ms": max(model.mixed_eager_floor_s, kernel_s) * 1e3,
                              "piecewise_ms": (kernel_s + 0.003) * 1e3})
    return {"piecewise_buckets": list(range(16, 257, 16)), "cases": cases}


def test_the_fit_recovers_known_coefficients_from_synthetic_steps():
    fitted = fit_mixed_step_grid(BASE, synthetic_grid(TRUE))
    for name in GRID_TERMS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fitted.prefill_per_token_s == BASE.prefill_per_token_s  # the rest kept


def test_with_the_grid_terms_at_zero_the_step_is_the_roofline_form_exactly():
    rng = np.random.default_rng(0)
    for _ in range(200):
        batch, context = int(rng.integers(0, 64)), int(rng.integers(0, 300_000))
        pieces = [(int(rng.integers(0, 20_000)), int(rng.integers(1, 1024)))
                  for _ in range(int(rng.integers(1, 4)))]
        tokens = batch + sum(n for _, n in pieces)
        roofline = (max(BASE.decode_base_s + BASE.decode_per_request_s * batch,
                        BASE.prefill_per_token_s * tokens)
                    + BASE.prefill_per_token_sq_s * sum((d + n) ** 2 - d ** 2 for d, n in pieces)
                    + BASE.decode_per_kv_token_s * context)
        assert mixed_step_s(BASE, batch, context, pieces) == roofline


def test_a_small_piece_over_a_long_prefix_pays_the_floor_a_large_one_the_pairs():
    small, large = (mixed_step_s(TRUE, 0, 0, [(16384, n)]) - mixed_step_s(TRUE, 0, 0, [(0, n)])
                    for n in (64, 1024))
    assert small == pytest.approx(1.3e-6 * 16384)
    assert large == pytest.approx(4e-9 * 1024 * 16384)
    # Past the graphs' largest step a step runs eagerly, never under the launch floor.
    assert mixed_step_s(TRUE, 0, 0, [(0, 257)]) == pytest.approx(0.03)


def test_the_committed_h200_grid_is_fitted_within_a_few_percent_of_its_kernel_time():
    grid = json.loads(GRID.read_text())
    validation = json.loads((RESULTS / "sim_validate_instance_h200_8ccd9ac.json").read_text())
    model = fit_mixed_step_grid(
        LatencyModel(**validation["schedules"]["chunk512"]["latency_model"]), grid)
    assert model.mixed_graph_max_tokens == 256
    assert 1.2e-6 < model.mixed_prefix_floor_per_token_s < 1.4e-6
    errors = np.array([grid_case_s(model, c) / (c["kernel_sum_ms"] / 1e3) - 1
                       for c in grid["cases"]])
    assert np.median(np.abs(errors)) < 0.03 and np.abs(errors).max() < 0.2
