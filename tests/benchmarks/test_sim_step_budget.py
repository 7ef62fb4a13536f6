"""``benchmarks/sim_step_budget.py``: chunked prefill with steps sized to an inter-token
target, simulated with a committed H200 validation's model, beside committed LooGLE-like
records of the same requests (offline, no GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
VALIDATION = RESULTS / "sim_validate_instance_h200_6b7fcf7.json"
GRID = RESULTS / "mixed_step_grid_h200_wide_6b7fcf7.json"
REQUESTS = RESULTS / "goodput_h200" / "loogle__chunk1024__r0.5.json"  # 40 requests at 0.5
CHUNK512 = RESULTS / "loogle_h200" / "40a9906_chunk512_rate0.5_records.json"
# The chunked records of these requests from the two newest revisions that ran them.
CHUNKED = [RESULTS / "loogle_h200" / f"{revision}_chunk{chunk}_rate0.5_records.json"
           for revision in ("40a9906", "6f2d50e") for chunk in (512, 1024)]


def _script():
    path = ROOT / "benchmarks" / "sim_step_budget.py"
    spec = importlib.util.spec_from_file_location("sim_step_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**overrides) -> argparse.Namespace:
    args = dict(validation=VALIDATION, mixed_step_grid=[GRID], record=REQUESTS, measured=[],
                chunks=[], budgets_ms=[], budget_chunk=2048, attention_scales=[1.0],
                rates=None, ttft_slo_s=15.0, tpot_slo_ms=60.0, prefill_order="fcfs",
                prefill_order_max_wait_ms=None)
    return argparse.Namespace(**{**args, **overrides})


def test_a_loadgen_record_reads_as_samples_with_its_chunk_size_from_its_label():
    module = _script()
    record = json.loads(CHUNK512.read_text())
    samples = module.samples_of(record)
    first = min(record["requests"], key=lambda r: r["sent_at"])
    assert samples[0]["prompt_len"] == first["input_len"]
    assert samples[0]["tpot_ms"] == pytest.approx((first["e2e"] - first["ttft"]) / 63 * 1e3)
    assert module.chunk_size_of(record) == 512
    assert module.chunk_size_of(json.loads(REQUESTS.read_text())) == 1024
    found = module.figures(samples, 15.0, 0.06)
    assert found["input_throughput"] == pytest.approx(record["summary"]["input_throughput"],
                                                      rel=0.01)


def test_the_model_sets_the_chunked_records_of_these_requests_within_7_percent():
    """Chunk 512 and 1024 as measured at 40a9906 and 6f2d50e against the model on the same
    requests: TTFT P50 and the input throughput. Were the model off on this workload, the
    budgeted steps' figures would mean nothing."""
    module = _script()
    result = module.run(_args(measured=CHUNKED))
    for row in result["measured"]:
        assert row["same_prompts"]
        measured, simulated = row["measured"], row["simulated"]["with_spread"]
        assert simulated["ttft_s"]["p50"] == pytest.approx(measured["ttft_s"]["p50"], rel=0.07)
        assert simulated["input_throughput"] == pytest.approx(
            measured["input_throughput"], rel=0.03)


def test_budgeted_steps_hold_tpot_to_the_budget_and_prefill_faster_with_a_larger_one():
    module = _script()
    result = module.run(_args(budgets_ms=[40.0, 60.0, 80.0]))
    rows = [c["medians_only"] for c in result["configurations"]]
    for config, row in zip(result["configurations"], rows, strict=True):
        assert row["tpot_s"]["p99"] <= config["step_budget_ms"] / 1e3 * 1.001
    throughput = [row["input_throughput"] for row in rows]
    assert throughput == sorted(throughput) and throughput[0] < throughput[-1]
    assert result["kind"] == "simulation" and result["requests"] == 40


def test_rescaled_arrivals_are_the_probes_own_and_faster_attention_prefills_faster():
    module = _script()
    record = RESULTS / "goodput_h200" / "loogle__chunk256__r0.6.json"
    samples = module.samples_of(json.loads(record.read_text()))
    again = module.rescaled(samples, 0.6)
    assert [s["send_s"] for s in again] == pytest.approx([s["send_s"] for s in samples],
                                                         abs=0.01)
    result = module.run(_args(record=record, rates=[0.6], chunks=[256],
                              attention_scales=[1.0, 0.67]))
    plain, faster = (c["medians_only"] for c in result["configurations"])
    assert faster["ttft_s"]["p50"] < plain["ttft_s"]["p50"]


def test_rates_are_refused_for_a_trace_whose_requests_change_with_the_rate():
    module = _script()
    trace = RESULTS / "goodput_h200" / "mooncake__chunk512-graph512__r0.3.json"
    with pytest.raises(SystemExit, match="a trace draws other requests"):
        module.run(_args(record=trace, rates=[0.35], chunks=[512]))
    with pytest.raises(SystemExit, match="needs a goodput probe's record"):
        module.run(_args(record=CHUNK512, rates=[0.6], chunks=[512]))


def test_the_slo_order_meets_more_ttfts_past_the_knee_and_a_bound_needs_it():
    """Chunk 256 on the 0.65 req/s probe's prompts sent at 0.7: served in SLO order, more
    first tokens come within 15 s than in arrival order, at the same prefill rate."""
    module = _script()
    record = RESULTS / "goodput_h200" / "loogle__chunk256__r0.65.json"
    fcfs, slo = (module.run(_args(record=record, rates=[0.7], chunks=[256],
                                  prefill_order=order))["configurations"][0]["medians_only"]
                 for order in ("fcfs", "slo"))
    assert slo["attainment"] > fcfs["attainment"]
    assert slo["input_throughput"] == pytest.approx(fcfs["input_throughput"], rel=0.01)
    with pytest.raises(SystemExit):  # argparse's error: the bound binds only the SLO order
        module.main(["--validation", str(VALIDATION), "--record", str(record),
                     "--prefill-order-max-wait-ms", "30000", "--out", "unused.json"])
