"""The decode-GEMV benchmarks' own logic: the A/B speedup lines of bench_engine.py and the
config table of bench_gemv.py (their GPU runs are not for CI)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from pdserve.model.arch import PRESETS
from pdserve.ops.dispatch import triton_available

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _result(mode: str, step_ms: dict[int, float]) -> dict:
    rows = [{"batch": b, "context": 1024, "overlap": True, "decode_gemv": mode,
             "step_ms": ms, "fraction_of_roofline": 15.8 / ms} for b, ms in step_ms.items()]
    rows.append({"batch": 256, "context": 1024, "overlap": True, "decode_gemv": mode,
                 "skipped": "KV pool too small for this batch and context"})
    return {"model": "codellama-34b", "decode": rows}


def test_speedup_pairs_off_and_on_of_the_same_point():
    bench = _load("bench_engine")
    results = [_result("off", {1: 18.0, 8: 20.0}), _result("on", {1: 16.0, 8: 25.0})]
    lines = bench.decode_gemv_speedups(results)
    assert [(line["batch"], line["decode_gemv_speedup"]) for line in lines] == \
        [(1, 18.0 / 16.0), (8, 20.0 / 25.0)]
    assert lines[0]["fraction_of_roofline_on"] == 15.8 / 16.0
    assert bench.decode_gemv_speedups([_result("off", {1: 18.0})]) == []


def test_decode_gemv_and_point_arguments():
    bench = _load("bench_engine")
    assert bench._gemv_modes("off,on") == ("off", "on")
    with pytest.raises(argparse.ArgumentTypeError, match="off, on, or off,on"):
        bench._gemv_modes("off,fast")
    assert bench._int_list("1,2,4,8") == (1, 2, 4, 8)
    assert bench._int_list("none") == ()


@pytest.mark.skipif(not triton_available(), reason="bench_gemv.py imports triton")
def test_gemv_sweep_shapes_candidates_and_table():
    bench = _load("bench_gemv")
    shapes = bench.projections(PRESETS["codellama-34b"])
    assert {name: shape[:2] for name, shape in shapes.items()} == {
        "qkv": (10240, 8192), "o_proj": (8192, 8192), "gate_up": (44032, 8192),
        "down": (8192, 22016)}
    assert not any(c.use_dot for c in bench.candidates(1))
    assert all(c.use_dot for c in bench.candidates(8))
    best = {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 3, "use_dot": False,
            "us": 40.0}
    table = bench.config_table([{"n": 8192, "k": 8192, "rows": 3, "best": best}])
    assert table == ["    (8192, 8192, 4): GemvConfig(block_n=8, block_k=512, num_warps=4, "
                     "num_stages=3, use_dot=False),"]
