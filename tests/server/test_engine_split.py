"""The engine's SM split and batch sizes reach users: ``/metrics`` gauges (read by the
benchmark's timeline poller) and ``GET /v1/engine/timeline``."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.bench.plots import series_unit
from pdserve.bench.timeline import parse_prometheus
from pdserve.messages import MUX_MODES
from pdserve.sched.mux_planner import MuxMode

pytest.importorskip("openai")

pytestmark = pytest.mark.slow

KEY = "sk-split"
SPLIT_GAUGES = ("pdserve_decode_sms", "pdserve_prefill_sms", "pdserve_decode_batch_size",
                "pdserve_prefill_batch_tokens")


def _mode(metrics: dict[str, float]) -> str:
    modes = [k for k, v in metrics.items() if k.startswith("pdserve_mux_mode{") and v == 1]
    assert len(modes) == 1, modes
    return modes[0].split('"')[1]


def _timeline(server, query: str = "") -> dict:
    status, _, body = server.request("GET", "/v1/engine/timeline" + query)
    assert status == 200, body
    return json.loads(body)


def test_modes_match_the_planner():
    assert set(MUX_MODES) == {str(m) for m in MuxMode} | {"disagg"}  # disagg: one fixed split


def test_bench_poller_picks_up_the_split():
    text = "\n".join(f"{name} 3.0" for name in SPLIT_GAUGES)
    found = parse_prometheus(text)
    assert set(found) == set(SPLIT_GAUGES)
    sms = [n for n in found if series_unit(n) == "SMs"]
    assert sms == ["pdserve_decode_sms", "pdserve_prefill_sms"]


def test_chunked_reports_no_split(server):
    before = _timeline(server, "?since=1e12")["now"]
    server.openai().completions.create(model="tiny", prompt="x", max_tokens=4,
                                       extra_body={"ignore_eos": True})
    metrics = server.metrics()
    for name in SPLIT_GAUGES:
        assert name in metrics, name
    assert metrics["pdserve_decode_sms"] == metrics["pdserve_prefill_sms"] == 0
    assert _mode(metrics) == "none"
    body = _timeline(server, f"?since={before}")
    assert body["object"] == "engine.timeline"
    steps = body["entries"]  # chunked prefill's timeline: its steps, no SM split
    assert sum(e["decode_batch"] for e in steps) == 3  # the tokens after the first
    assert steps and not any("decode_sms" in e for e in steps)
    assert _timeline(server, f"?since={body['now']}")["entries"] == []
    assert server.request("GET", "/v1/engine/timeline?since=soon")[0] == 400


@pytest.fixture(scope="module")
def mux(launch):
    return launch("--schedule", "multiplex", "--max-num-seqs", "16", api_key=KEY)


def test_multiplex_split_flows_to_users(mux):
    start = _timeline(mux, "?since=1e12")
    assert start["entries"] == []
    done = mux.openai().completions.create(model="tiny", prompt="split " * 40, max_tokens=12,
                                           extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 12
    entries = _timeline(mux, f"?since={start['now']}")["entries"]
    assert entries and all(e["time"] >= start["now"] for e in entries)
    assert {e["mode"] for e in entries} <= set(MUX_MODES)
    assert any(e["decode_batch"] == 1 for e in entries)
    assert any(e["prefill_tokens"] > 0 for e in entries)
    assert all(e["decode_sms"] > 0 or e["prefill_sms"] > 0 for e in entries)
    assert all(0.5 <= e["calibration"] <= 2.0 for e in entries)
    metrics = _wait_snapshot(mux, entries[-1])
    assert metrics["pdserve_decode_batch_size"] == metrics["pdserve_prefill_batch_tokens"] == 0


def _wait_snapshot(server, last: dict, timeout: float = 10) -> dict[str, float]:
    """The gauges once the engine's idle snapshot (sent within ~200 ms) has arrived."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        split = (_mode(metrics), metrics["pdserve_decode_sms"], metrics["pdserve_prefill_sms"])
        if split == (last["mode"], last["decode_sms"], last["prefill_sms"]) and \
                metrics["pdserve_decode_batch_size"] == 0:
            return metrics
        assert time.monotonic() < deadline, (split, last)
        time.sleep(0.1)


def test_timeline_needs_the_api_key(mux):
    status, _, _ = mux.request("GET", "/v1/engine/timeline", headers={"Authorization": ""})
    assert status == 401


def test_engine_info_says_what_runs(server, mux):
    """Results record this: a CPU run must read as emulated partitions and the roofline."""
    _, _, body = mux.request("GET", "/v1/engine/info")
    info = json.loads(body)
    assert info["schedule"] == "multiplex" and info["device"] == "cpu"
    assert info["partitions"]["kind"] == "emulated" and info["partitions"]["splits"]
    assert info["predictor"]["kind"] == "roofline" and info["predictor"]["why"]
    _, _, body = server.request("GET", "/v1/engine/info")
    info = json.loads(body)
    assert info["schedule"] == "chunked" and "partitions" not in info


def test_engine_info_counters_are_live(server):
    """Results read the overlap counters after a run: they must be the engine's counts now,
    not the start-up snapshot's zeros."""
    def overlapped_steps() -> int:
        status, _, body = server.request("GET", "/v1/engine/info")
        assert status == 200, body
        return json.loads(body)["overlap_schedule"]["overlapped_steps"]

    before = overlapped_steps()
    server.openai().completions.create(model="tiny", prompt="count", max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert overlapped_steps() >= before + 7  # one overlapped step per token after the first
