"""The harness through the real server and the in-process engine on the tiny model (CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from bench_standin import free_port

from pdserve.bench.cli import main


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


needs_server = pytest.mark.skipif(
    not (_importable("pdserve.server.app") and _importable("pdserve.__main__")),
    reason="pdserve.server is not importable yet (the server lands separately)")
needs_engine = pytest.mark.skipif(not _importable("pdserve.engine.core"),
                                  reason="pdserve.engine.core is not importable yet")


@pytest.mark.slow
@needs_server
def test_compare_through_real_server_on_tiny(tmp_path):
    out = tmp_path / "tiny.json"
    code = main(["compare", "--model", "tiny", "--port", str(free_port()),
                 "--config", "chunked64=--schedule chunked --chunk-size 64",
                 "--config", "multiplex=--schedule multiplex --itl-slo-ms 200",
                 "--workload", "random:num=6,rate=8,input_len=48,output_len=6,range_ratio=0.5",
                 "--ttft-slo-ms", "5000", "--itl-slo-ms", "1000", "--no-progress",
                 "--timeline-interval-ms", "50", "--startup-timeout-s", "240",
                 "--out", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["chunked64", "multiplex"]
    for run in runs:
        assert "error" not in run, run.get("error")
        assert run["completed"] == 6 and run["failed"] == 0
        assert all(s["output_tokens"] == s["output_len"] for s in run["samples"])
        # return_engine_timing: every token is counted even when its text is held back.
        assert all(len(s["itl_ms"]) == s["output_len"] - 1 for s in run["samples"])
        assert run["ttft_ms"]["p50"] > 0 and 0.0 <= run["slo_attainment"] <= 1.0
        assert any("pdserve_num_requests_running" in s for s in run["timeline"])
    # Only the multiplex engine keeps an SM-split history; it lands on the run's time axis.
    assert not runs[0]["engine_timeline"]
    split = runs[1]["engine_timeline"]
    assert split and all(-1.0 < e["t"] < runs[1]["duration_s"] + 1.0 for e in split)
    assert {e["mode"] for e in split} <= {"spatial", "temporal", "prefill_only", "decode_only"}
    assert list((tmp_path / "plots").glob("split_multiplex_*.png"))


@pytest.mark.slow
@needs_engine
def test_in_process_engine_backend(tmp_path):
    out = tmp_path / "engine.json"
    code = main(["serve", "--backend", "engine", "--model", "tiny",
                 "--engine-arg", "schedule=chunked", "--engine-arg", "chunk_size=64",
                 "--num-prompts", "5", "--random-input-len", "40", "--random-output-len", "5",
                 "--request-rate", "20", "--ttft-slo-ms", "5000", "--itl-slo-ms", "1000",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 5, [s["error"] for s in result["samples"]]
    assert all(s["output_tokens"] == 5 and len(s["itl_ms"]) == 4 for s in result["samples"])
    assert any(step["batch_requests"] > 0 for step in result["timeline"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
