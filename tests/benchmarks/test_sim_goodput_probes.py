"""``benchmarks/sim_goodput_probes.py``: the chunked instance model against committed H200
goodput probes, with the fit of a committed validation run (offline, no GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _script():
    path = ROOT / "benchmarks" / "sim_goodput_probes.py"
    spec = importlib.util.spec_from_file_location("sim_goodput_probes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probes_at_the_validations_revision_are_simulated_beside_their_records():
    module = _script()
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    probes = module.default_probes(validation)
    assert {p.stem for p in probes} == {"mooncake__chunk512__r0.3", "mooncake__chunk1024__r0.3"}
    result = module.run(validation, probes)
    assert result["kind"] == "validation" and result["num_instances"] == 1
    assert result["mixed_step_extra_fitted_on"] == "queue probe"
    for path in probes:
        probe, record = result["probes"][path.stem], json.loads(path.read_text())
        assert probe["same_revision"] and probe["requests"] == len(record["samples"])
        assert probe["chunk_size"] == int(path.stem.split("__")[1].removeprefix("chunk"))
        # The attainment counted from the records is the one the probe reported.
        assert probe["attainment"]["measured"] == pytest.approx(
            record["summary"]["slo_attainment"])
        measured = probe["compare"]["ttft_s"]["measured"]
        assert measured["p50"] == pytest.approx(record["summary"]["ttft_ms"]["p50"] / 1e3,
                                                rel=1e-6)


def test_a_larger_chunk_prefills_faster_in_the_model_as_measured():
    """The same requests, chunk 512 against chunk 1024: both measured and simulated
    TTFT P50 fall with the larger chunk."""
    module = _script()
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    result = module.run(validation, module.default_probes(validation))
    small, large = (result["probes"][f"mooncake__chunk{c}__r0.3"]["compare"]["ttft_s"]
                    for c in (512, 1024))
    for figures in ("measured", "simulated_medians_only"):
        assert large[figures]["p50"] < small[figures]["p50"]


def test_a_probe_of_another_schedule_is_refused_and_an_imported_one_skipped():
    module = _script()
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    other = RESULTS / "goodput_h200" / "mooncake__prefill-first__r0.3.json"
    with pytest.raises(SystemExit, match="not a chunked probe"):
        module.run(validation, [other])
    imported = RESULTS / "goodput_h200" / "loogle__chunk512__r0.5.json"
    result = module.run(validation, [imported])
    assert result["probes"] == {} and "no SLO summary" in result["skipped"][imported.stem]


def test_with_the_grid_terms_the_small_chunks_come_close_and_the_grid_is_recorded():
    """Chunk 256 over the Mooncake trace: the roofline form's TTFT P50 about 22% short; with
    the mixed step fitted on the measured grid within 10%."""
    module = _script()
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    grid = RESULTS / "mixed_step_grid_h200_d92d053.json"
    probes = [RESULTS / "goodput_h200" / "mooncake__chunk256__r0.3.json"]
    before, after = module.run(validation, probes), module.run(validation, probes, [grid])
    assert before["mixed_step_form"] == "roofline" and after["mixed_step_form"] == "grid"
    assert after["mixed_step_grid"] == "benchmarks/results/mixed_step_grid_h200_d92d053.json"
    assert after["mixed_step_grid_revision"].startswith("d92d053")
    assert after["mixed_step_grid_terms"]["mixed_graph_max_tokens"] == 256
    (name,) = after["probes"]
    errors = [r["probes"][name]["compare"]["ttft_s"]["simulated_error"]["p50"]
              for r in (before, after)]
    assert errors[0] < -0.15 and abs(errors[1]) < 0.10


def _chunk512_model():
    from pdserve.sim.cluster import LatencyModel

    validation = json.loads((RESULTS / "sim_validate_instance_h200_8ccd9ac.json").read_text())
    return LatencyModel(**validation["schedules"]["chunk512"]["latency_model"])


def test_the_step_check_sets_each_recorded_step_beside_the_model():
    """Steps recorded 20% over the model's mixed steps and on it for decode alone: the
    check finds each group's ratio, and the run's total between the two."""
    from pdserve.sim.instance import recorded_step_s
    from pdserve.sim.step_check import batch_band, step_check

    model = _chunk512_model()
    decode = {"mode": "decode_only", "path": "decode_graph", "decode_batch": 140,
              "decode_context_tokens": 84_000, "prefill_pieces": [], "measured_cycle_ms": 0.0}
    mixed = {**decode, "mode": "mixed", "path": "piecewise_graph",
             "prefill_pieces": [[512, 300], [0, 72]]}
    timeline = []
    for entry, over in [(decode, 1.0)] * 30 + [(mixed, 1.2)] * 10:
        modelled_ms = recorded_step_s(model, entry, 0.0015) * 1e3
        timeline.append({**entry, "measured_device_ms": over * modelled_ms})
    timeline.append({**decode, "measured_device_ms": 0.0, "measured_cycle_ms": 25.0})
    timeline.append({**decode, "measured_device_ms": 0.0})  # never timed: left out
    check = step_check(model, 0.0015, timeline)
    assert check["steps"] == 41 and check["clock"] == "both"
    groups = {(g["mode"], g["decode_batch"]): g for g in check["groups"]}
    assert set(groups) == {("decode_only", "129-256"), ("mixed", "129-256")}
    assert groups["mixed", "129-256"]["ratio_p10_p50_p90"] == pytest.approx([1.2] * 3)
    assert groups["decode_only", "129-256"]["steps"] == 31
    assert groups["decode_only", "129-256"]["ratio_p10_p50_p90"][1] == pytest.approx(1.0)
    assert 1.0 < check["measured_over_modelled"] < 1.2
    assert check["measured_s"] == pytest.approx(sum(g["measured_s"] for g in groups.values()))
    assert [batch_band(b) for b in (0, 1, 8, 9, 256, 300)] == [
        "0", "1-8", "1-8", "9-32", "129-256", "257+"]


def test_a_served_runs_steps_go_through_the_check_and_old_probes_are_listed():
    """The step timeline of a chunked run on the CPU (host clock) is checked step by step;
    a committed probe recorded before the engine kept steps is listed as without one."""
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams
    from pdserve.sim.step_check import step_check

    module = _script()
    llm = LLM("tiny", device="cpu", schedule="chunked", chunk_size=64,
              max_num_batched_tokens=64)
    llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (90, 30, 12)],
                 SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    timeline = llm.engine.timeline()
    check = step_check(_chunk512_model(), 0.0, timeline)
    assert check["steps"] == len(timeline) and check["clock"] == "host"
    assert {g["mode"] for g in check["groups"]} == {"prefill_only", "mixed", "decode_only"}
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    probe = RESULTS / "goodput_h200" / "mooncake__chunk512__r0.3.json"
    result = module.run(validation, [probe], steps=True)
    assert "steps" not in result["probes"][probe.stem]
    assert probe.stem in result["steps_skipped"]
    # A multiplex probe is taken with --steps alone; its timeline predates the decisions'
    # shapes, so it has no steps to check either.
    mux = RESULTS / "goodput_h200" / (
        "sharegpt__multiplex-graph512-floor-converging-noslice-itl60__r17__rep7.json")
    result = module.run(validation, [mux], steps=True)
    assert result["probes"] == {} and mux.stem in result["steps_skipped"]
    with pytest.raises(SystemExit, match="not a chunked probe"):
        module.run(validation, [mux])


def test_the_decode_step_refitted_on_an_engine_benchmarks_rows():
    """The 8ccd9ac validation timed decode at 1-32 requests; the engine A/B at fdd80df timed
    1-256 at 1K contexts. Refitted on both, the model's step at 256 decodes comes near the
    engine's (the validation's fit alone leaves it 17% short); without the engine's rows the
    model is the validation's as it was."""
    from pdserve.sim.cluster import LatencyModel

    module = _script()
    validation = json.loads((RESULTS / "sim_validate_instance_h200_8ccd9ac.json").read_text())
    fitted = validation["schedules"]["chunk512"]
    model = LatencyModel(**fitted["latency_model"])
    points = fitted["service_points"]["decode"]
    assert module.with_engine_decode(model, points, None) == (
        model, {"decode_fit": "the validation's"})
    engine = RESULTS / "engine_h200_codellama34b_ab_fdd80df_vs_e8fb095.json"
    rows = module.engine_decode_rows(json.loads(engine.read_text()))
    assert [r["batch"] for r in rows] == [1, 16, 48, 128, 256] * 2  # the new revision's runs
    refitted, recorded = module.with_engine_decode(model, points, engine)
    assert recorded["decode_fit"]["engine_rows"] == 10
    at_256 = {r["step_ms"] for r in rows if r["batch"] == 256}
    engine_ms = sum(at_256) / len(at_256)
    assert model.decode_step_s(256, 256 * 1024) * 1e3 < 0.85 * engine_ms
    assert refitted.decode_step_s(256, 256 * 1024) * 1e3 == pytest.approx(engine_ms, rel=0.10)
    # The validation's own points stay fitted: within 5% at batch 1.
    one = next(p for p in points if p["batch"] == 1)
    assert refitted.decode_step_s(1, one["context"]) * 1e3 == pytest.approx(one["step_ms"],
                                                                             rel=0.05)


def test_several_grids_are_fitted_as_one():
    """A grid at other decode batches measured later adds its steps to the first; grids
    measured with other prefill-step graphs are refused."""
    module = _script()
    grid = json.loads((RESULTS / "mixed_step_grid_h200_d92d053.json").read_text())
    merged = module.merged_grid([grid, {**grid, "git_revision": "b" * 40}])
    assert len(merged["cases"]) == 2 * len(grid["cases"])
    assert merged["git_revision"] == f"{grid['git_revision']}, {'b' * 40}"
    with pytest.raises(SystemExit, match="different prefill-step graphs"):
        module.merged_grid([grid, {**grid, "piecewise_buckets": [1, 2]}])


def test_a_loogle_row_is_simulated_in_both_orders():
    """A ``loogle_h200.py`` row (its client records beside it) at 0.5 req/s, where the queue
    grows: in SLO order the model meets more 15 s TTFTs than in arrival order and its
    median falls, the prompts put last waiting longer."""
    module = _script()
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    row = RESULTS / "loogle_h200" / "6a43faf_chunk256_rate0.5.json"
    probe = module.run(validation, [row], slo_order=True)["probes"][row.stem]
    assert probe["requests"] == 40 and probe["chunk_size"] == 256
    assert probe["attainment"]["measured"] == pytest.approx(0.3)
    ttft = probe["compare"]["ttft_s"]
    assert ttft["simulated_slo_order"]["p50"] < ttft["simulated"]["p50"]
    assert ttft["simulated_slo_order"]["p99"] > ttft["simulated"]["p99"]
    attained = probe["attainment"]
    assert attained["simulated_slo_order"] > attained["simulated"]


def test_a_wait_bound_trades_slo_order_attainment_for_its_tail():
    """The same row in SLO order with a 30 s wait bound: the prompts the order put last
    wait less (TTFT P99 down), the meetable ones they pass pay (attainment down)."""
    module = _script()
    validation = RESULTS / "sim_validate_instance_h200_8ccd9ac.json"
    row = RESULTS / "loogle_h200" / "6a43faf_chunk256_rate0.5.json"
    free, bound = (module.run(validation, [row], slo_order=True, max_wait_s=wait)
                   ["probes"][row.stem] for wait in (None, 30.0))
    free_ttft, bound_ttft = (p["compare"]["ttft_s"]["simulated_slo_order"] for p in (free, bound))
    assert bound_ttft["p99"] < free_ttft["p99"]
    assert bound["attainment"]["simulated_slo_order"] < free["attainment"]["simulated_slo_order"]
    assert bound["attainment"]["simulated"] == free["attainment"]["simulated"]  # FCFS: no bound


def test_a_loogle_h200_row_with_a_failed_request_is_not_replayed():
    module = _script()
    requests = [{"input_len": 330, "sent_at": 0.0, "ok": False, "ttft": 0.0, "e2e": 0.0,
                 "output_len": 40}]
    row = {"config": "multiplex", "rate": 2.0, "git_revision": "0", "attainment": 0.0,
           "server_command": "python -m pdserve serve tiny --schedule chunked --chunk-size 256"}
    with pytest.raises(SystemExit, match="1 requests failed"):
        module.probe_of_loogle_row(row, requests)
