"""The chunked instance model (``ChunkedInstanceSim``) against the H200 goodput probes of
chunked prefill on the Mooncake trace: each probe's requests (send time, prompt and output
lengths from its per-request records) simulated with the latency model, measured spread and
mixed-step extra cost that a validation run fitted (``sim_validate_instance.py``), the
measured and simulated P50 / P99 of TTFT and TPOT side by side, and the SLO attainment.

A held-out check of the model that validation fitted: there the replay's prompts are at
most 8,192 tokens at about 60% prefill load, while the probes run the trace's prompts up to
24,576 tokens at their own rates. A probe of another revision than the validation is
compared too, and says so (``same_revision``). No GPU, no server::

    python benchmarks/sim_goodput_probes.py \\
        --validation benchmarks/results/sim_validate_instance_h200_8ccd9ac.json \\
        --out sim_goodput_probes_h200_8ccd9ac.json

``--mixed-step-grid GRID.json [...]`` (``bench_mixed_step.py --grid`` results, their steps
together) fits the mixed step's grid terms on top of the validation's model
(``fit_mixed_step_grid``: the prefix attention's floor, the graph and eager steps' costs),
refits the extra cost per mixed step on the validation's queue probe with them, and records
the grids and their revisions. ``--decode-points-from ENGINE.json`` refits the decode step
on the validation's decode points and an engine benchmark's decode rows.

``--steps`` also sets every step of a probe's step timeline (kept beside its record as
``<record>_timeline.json.gz`` by ``goodput_h200.py``; ``pdserve.sched.steps``) beside the
model's time for that step's shape (``recorded_step_s``): in an overloaded probe the queue
turns a few percent of step time into tens of percent of TTFT, so this says which steps
(by mode, path and decode batch) the model gets wrong. With ``--steps`` a multiplex probe
is taken too, for its whole-GPU steps only (mixed steps and decode alone, the shapes this
model prices; its latencies are another schedule's). Probes recorded before the engine
kept steps (or their shapes) are listed in ``steps_skipped``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.loogle_h200 import TPOT_SLO_S, TTFT_SLO_S  # noqa: E402  (its attainment)
from benchmarks.sim_validate_instance import fit_mixed_step_extra, latency_rows  # noqa: E402
from benchmarks.validate_sim import compare_percentiles, percentiles  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.bench.timeline import load_engine_timeline, timeline_beside  # noqa: E402
from pdserve.sim.cluster import LatencyModel, ServiceNoise, SimRequest  # noqa: E402
from pdserve.sim.instance import (  # noqa: E402
    ChunkedInstanceSim,
    fit_mixed_step_grid,
    grid_case_s,
    on_graphs,
)
from pdserve.sim.step_check import step_check  # noqa: E402

GOODPUT = ROOT / "benchmarks" / "results" / "goodput_h200"
VALIDATION = ROOT / "benchmarks" / "results" / "sim_validate_instance_h200_8ccd9ac.json"


def load_probe(path: Path) -> dict:
    """A goodput probe as ``goodput_h200.py`` writes it, or a ``loogle_h200.py`` row (its
    client's records beside it) in that form."""
    record = json.loads(path.read_text())
    if "samples" in record or "server_command" not in record:
        return record
    records = json.loads(path.with_name(f"{path.stem}_records.json").read_text())
    return probe_of_loogle_row(record, records["requests"])


def probe_of_loogle_row(row: dict, requests: list[dict]) -> dict:
    """A ``loogle_h200.py`` row as the probe the replay reads: its server's flags (after
    ``serve <model>``), the engine it reported, its requests (TPOT over the tokens after
    the first, as that script's attainment takes it) and its SLOs."""
    command = shlex.split(row["server_command"])
    server_args = shlex.join(command[command.index("serve") + 2:])
    engine = row.get("engine_info") or {}
    samples = [{"send_s": r["sent_at"], "prompt_len": r["input_len"],
                "output_tokens": r["output_len"], "ttft_ms": r["ttft"] * 1e3,
                "tpot_ms": (r["e2e"] - r["ttft"]) / max(1, r["output_len"] - 1) * 1e3}
               for r in requests if r.get("ok")]
    if len(samples) != len(requests):
        raise SystemExit(f"{row['config']} at {row['rate']} req/s: "
                         f"{len(requests) - len(samples)} requests failed; nothing to replay")
    predictor = (engine.get("predictor") or {}).get("path")
    return {"git_revision": row["git_revision"],
            "config": {"name": row["config"], "server_args": server_args, "engine": engine},
            "probe": {"workload": "loogle", "config": row["config"], "rate": row["rate"],
                      "requests": len(samples)},
            **({"predictor": {"path": predictor}} if predictor else {}),
            "partitions": engine.get("partitions") or {},
            "samples": samples,
            "summary": {"slo": {"ttft_ms": TTFT_SLO_S * 1e3, "itl_ms": TPOT_SLO_S * 1e3},
                        "slo_attainment": row["attainment"]}}


def chunk_size_of(record: dict) -> int | None:
    """The chunk size of a chunked probe's server (None: another schedule)."""
    match = re.search(r"--schedule chunked --chunk-size (\d+)", record["config"]["server_args"])
    return int(match.group(1)) if match else None


def requests_of(record: dict) -> list[SimRequest]:
    return [SimRequest(s["send_s"], s["prompt_len"], s["output_tokens"])
            for s in record["samples"]]


def measured_rows(record: dict) -> list[dict]:
    return [{"ttft_s": s["ttft_ms"] / 1e3, "tpot_s": s["tpot_ms"] / 1e3}
            for s in record["samples"]]


def simulated_rows(model: LatencyModel, chunk: int, requests: list[SimRequest],
                   extra_s: float, noise: ServiceNoise | None,
                   slo_order_ttft_s: float | None = None,
                   max_wait_s: float | None = None) -> list[dict]:
    """With ``slo_order_ttft_s``, the queue in SLO order (``--prefill-order slo``) at that
    TTFT SLO, prompts waiting ``max_wait_s`` first; else first come, first served."""
    fresh = [SimRequest(r.arrival, r.input_len, r.output_len) for r in requests]
    order = {} if slo_order_ttft_s is None else {"prefill_order": "slo",
                                                 "ttft_slo_s": slo_order_ttft_s,
                                                 "max_wait_s": max_wait_s}
    ChunkedInstanceSim(model, chunk_size=chunk, noise=noise, mixed_step_extra_s=extra_s,
                       overlap=True, **order).run(fresh)
    return latency_rows(fresh)


def attainment(rows: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> float:
    return sum(r["ttft_s"] <= ttft_slo_s and r["tpot_s"] <= tpot_slo_s
               for r in rows) / len(rows)


def compare_probe(record: dict, model: LatencyModel, extra_s: float,
                  noise: ServiceNoise, slo_order: bool = False,
                  max_wait_s: float | None = None) -> dict:
    """With ``slo_order``, also the probe's requests in SLO order (``simulated_slo_order``,
    a prediction: the probe ran in the order its flags name), with ``max_wait_s`` as the
    wait bound."""
    chunk, requests = chunk_size_of(record), requests_of(record)
    measured = measured_rows(record)
    slo = record["summary"]["slo"]
    ttft_slo, tpot_slo = slo["ttft_ms"] / 1e3, slo["itl_ms"] / 1e3
    simulated = {"simulated_medians_only": simulated_rows(model, chunk, requests, extra_s,
                                                          None),
                 "simulated": simulated_rows(model, chunk, requests, extra_s, noise)}
    if slo_order:
        simulated["simulated_slo_order"] = simulated_rows(model, chunk, requests, extra_s,
                                                          noise, ttft_slo, max_wait_s)
    figures = {key: percentiles(measured, key) for key in ("ttft_s", "tpot_s")}
    return {"chunk_size": chunk, "rate": record["probe"]["rate"],
            "requests": len(requests), "git_revision": record["git_revision"],
            "prompt_len_max": max(r.input_len for r in requests),
            "compare": compare_percentiles(figures, simulated),
            "attainment": {"measured": attainment(measured, ttft_slo, tpot_slo),
                           **{name: attainment(rows, ttft_slo, tpot_slo)
                              for name, rows in simulated.items()}}}


def is_multiplex(record: dict) -> bool:
    return "--schedule multiplex" in record["config"]["server_args"]


def steps_of(record_path: Path, model: LatencyModel, extra_s: float) -> dict | None:
    """``step_check`` of the steps kept beside a probe's record (None: none kept, or a
    multiplex timeline from before its decisions carried their shapes)."""
    timeline = timeline_beside(record_path)
    if not timeline.exists():
        return None
    found = step_check(model, extra_s, load_engine_timeline(timeline))
    return found if found["steps"] else None


def run(validation_path: Path, probe_paths: list[Path],
        grid_paths: Sequence[Path] = (),
        steps: bool = False, engine_path: Path | None = None, slo_order: bool = False,
        max_wait_s: float | None = None) -> dict:
    model, extra_s, noise, facts = chunked_model(validation_path, grid_paths, engine_path)
    revision = facts["model_revision"]
    probes, skipped, steps_skipped = {}, {}, {}
    for path in probe_paths:
        record = load_probe(path)
        if chunk_size_of(record) is None:
            if not (steps and is_multiplex(record)):
                raise SystemExit(f"{path}: not a chunked probe (the chunked model only; a "
                                 "multiplex probe's whole-GPU steps with --steps)")
            found = steps_of(path, model, extra_s)  # its latencies are not this model's
            if found is None:
                steps_skipped[path.stem] = "no step timeline beside the record"
            else:
                probes[path.stem] = {"schedule": "multiplex", "steps": found}
            continue
        if "summary" not in record:  # imported from a run before goodput_h200.py
            skipped[path.stem] = "no SLO summary: imported from an earlier runner"
            continue
        probes[path.stem] = {**compare_probe(record, model, extra_s, noise, slo_order,
                                             max_wait_s),
                             "same_revision": record["git_revision"] == revision}
        found = steps_of(path, model, extra_s) if steps else None
        if found is not None:
            probes[path.stem]["steps"] = found
        elif steps:
            steps_skipped[path.stem] = "no step timeline beside the record"
    found = {"steps_skipped": steps_skipped} if steps else {}
    return {"kind": "validation", "num_instances": 1, "skipped": skipped, **found, **facts,
            "probes": probes}


def chunked_model(validation_path: Path, grid_paths: Sequence[Path] = (),
                  engine_path: Path | None = None
                  ) -> tuple[LatencyModel, float, ServiceNoise, dict]:
    """The chunked instance's model as a validation run fitted it (its chunk512 fit), with
    the grid terms and the decode refit when given: (model, extra cost per mixed step, the
    measured spread of service times, what a result records of where they came from)."""
    validation = json.loads(validation_path.read_text())
    args = argparse.Namespace(**validation["config"])
    fitted = validation["schedules"]["chunk512"]
    model, decode_fit = with_engine_decode(LatencyModel(**fitted["latency_model"]),
                                           fitted["service_points"]["decode"], engine_path)
    model, grid_fit = with_grid(model, grid_paths)
    extra_s, checks = fit_mixed_step_extra(model, args, fitted["interference"])
    ratios = fitted["service_ratios"]
    noise = ServiceNoise(ratios["prefill"], ratios["decode_step"], seed=args.seed)
    facts = {"model_from": str(validation_path.relative_to(ROOT)),
             "model_revision": validation["git_revision"], **decode_fit,
             "mixed_step_extra_s": extra_s, "mixed_step_extra_fitted_on": checks.get("fitted_on"),
             **grid_fit}
    return model, extra_s, noise, facts


def with_engine_decode(model: LatencyModel, validation_points: list[dict],
                       engine_path: Path | None) -> tuple[LatencyModel, dict]:
    """The model with its decode step refitted on the validation's own decode points and an
    engine benchmark's decode rows (``bench_engine.py``'s JSON, or ``ab_engine.py``'s: its
    new revision's runs); and what the result records of it. None: the validation's decode
    fit as it is (its points reach 32 decodes, where served steps run to ~200)."""
    if engine_path is None:
        return model, {"decode_fit": "the validation's"}
    rows = engine_decode_rows(json.loads(engine_path.read_text()))
    points = validation_points + [{"batch": r["batch"], "context": r["context"],
                                   "step_ms": r["step_ms"]} for r in rows]
    refitted = model.fit_decode(points)
    terms = {k: v for k, v in dataclasses.asdict(refitted).items() if k.startswith("decode_")}
    return refitted, {"decode_fit": {"engine_rows_from": str(engine_path.relative_to(ROOT)),
                                     "engine_rows": len(rows), "terms": terms}}


def engine_decode_rows(record: dict) -> list[dict]:
    """Every decode row of a ``bench_engine.py`` result, or of the new revision's runs of an
    ``ab_engine.py`` one."""
    if record.get("kind") == "ab":
        runs = [run for run in record["runs"].values()
                if run["git_revision"] == record["new_revision"]]
    else:
        runs = [record]
    return [row for run in runs for model in run["models"] for row in model["decode"]]


def with_grid(model: LatencyModel, paths: Sequence[Path]) -> tuple[LatencyModel, dict]:
    """The model with the mixed step's grid terms fitted on the grids at ``paths`` (their
    steps together; none: as it is), and what the result records of that fit: the grids,
    the revisions they were measured at, the fitted terms."""
    if not paths:
        return model, {"mixed_step_form": "roofline"}
    grid = merged_grid([json.loads(path.read_text()) for path in paths])
    model = fit_mixed_step_grid(model, grid)
    terms = {k: v for k, v in dataclasses.asdict(model).items() if k.startswith("mixed_")}
    return model, {"mixed_step_form": "grid",
                   "mixed_step_grid": ", ".join(str(p.relative_to(ROOT)) for p in paths),
                   "mixed_step_grid_revision": grid["git_revision"],
                   "mixed_step_grid_terms": terms, "mixed_step_grid_fit": grid_fit(model, grid)}


def merged_grid(grids: list[dict]) -> dict:
    """Several measured grids as one: their steps together (each names its decode batch
    and context), measured with the same prefill-step graphs."""
    buckets = {tuple(g["piecewise_buckets"]) for g in grids}
    if len(buckets) != 1:
        raise SystemExit("the grids were measured with different prefill-step graphs")
    return {**grids[0], "cases": [c for g in grids for c in g["cases"]],
            "git_revision": ", ".join(g["git_revision"] for g in grids)}


def grid_fit(model: LatencyModel, grid: dict) -> dict:
    """Each grid step modelled against measured: its kernels' time (what the terms are
    fitted to) and its time from the host on the path serving runs it (synchronous: overlap
    scheduling hides part of the host's share in serving); median and worst error of each."""
    rows = [{"prefill_tokens": c["prefill_tokens"], "prefix": c["prefix"],
             "decodes": c["decodes"], "path": "graphs" if on_graphs(model, c) else "eager",
             "modelled_ms": grid_case_s(model, c) * 1e3, "kernel_sum_ms": c["kernel_sum_ms"],
             "host_timed_ms": c["piecewise_ms"] if on_graphs(model, c) else c["eager_ms"]}
            for c in grid["cases"]]
    summary = {}
    for measured in ("kernel_sum_ms", "host_timed_ms"):
        errors = [r["modelled_ms"] / r[measured] - 1 for r in rows]
        for row, error in zip(rows, errors, strict=True):
            row[f"error_against_{measured}"] = error
        worst = max(errors, key=abs)
        summary[measured] = {"median_abs_error": float(np.median(np.abs(errors))),
                             "worst_error": worst, "worst_case": rows[errors.index(worst)]}
    return {"summary": summary, "cases": rows}


def print_steps(check: dict) -> None:
    print(f"  steps ({check['clock']} clock): {check['steps']}, measured "
          f"{check['measured_s']:.2f} s against {check['modelled_s']:.2f} s modelled "
          f"({check['measured_over_modelled']:.3f})")
    for group in check["groups"]:
        p10, p50, p90 = group["ratio_p10_p50_p90"]
        print(f"    {group['mode']:>12} {group['path']:>15} decodes {group['decode_batch']:>7}: "
              f"{group['steps']:5d} steps, p50 {group['measured_ms_p50']:6.1f} ms measured / "
              f"{group['modelled_ms_p50']:6.1f} modelled, ratio {p10:.2f} / {p50:.2f} / {p90:.2f}")


def default_probes(validation_path: Path) -> list[Path]:
    """The chunked Mooncake probes committed at the validation's revision."""
    revision = json.loads(validation_path.read_text())["git_revision"]
    found = []
    for path in sorted(GOODPUT.glob("mooncake__chunk*__r*.json")):
        record = json.loads(path.read_text())
        if record["git_revision"] == revision and chunk_size_of(record) is not None:
            found.append(path)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validation", type=Path, default=VALIDATION,
                        help="a sim_validate_instance.py result whose chunk512 fit to use")
    parser.add_argument("--probes", type=Path, nargs="*",
                        help="goodput probe records of chunked configs (default: the "
                        "Mooncake ones at the validation's revision)")
    parser.add_argument("--mixed-step-grid", type=Path, nargs="+",
                        help="bench_mixed_step.py --grid results to fit the mixed step's "
                        "grid terms on (default: the roofline form the validation fitted)")
    parser.add_argument("--steps", action="store_true",
                        help="also set each probe's recorded steps beside the model's")
    parser.add_argument("--decode-points-from", type=Path,
                        help="refit the decode step on the validation's decode points and "
                        "this engine benchmark's decode rows (bench_engine.py or "
                        "ab_engine.py JSON)")
    parser.add_argument("--slo-order", action="store_true",
                        help="also simulate each probe's requests in SLO order "
                        "(--prefill-order slo at the probe's TTFT SLO): a prediction")
    parser.add_argument("--prefill-order-max-wait-ms", type=float,
                        help="with --slo-order: the engine's wait bound of that name "
                        "(prompts waiting that long are served first)")
    parser.add_argument("--out", type=Path, help="write the result here (JSON)")
    args = parser.parse_args()
    if args.prefill_order_max_wait_ms is not None and not args.slo_order:
        parser.error("--prefill-order-max-wait-ms bounds the SLO order: add --slo-order")
    max_wait_s = (None if args.prefill_order_max_wait_ms is None
                  else args.prefill_order_max_wait_ms / 1e3)
    validation = args.validation.resolve()
    probes = [p.resolve() for p in args.probes] if args.probes else default_probes(validation)
    if not probes:
        raise SystemExit("no chunked goodput probe to compare")
    grid = [path.resolve() for path in args.mixed_step_grid or []]
    engine = args.decode_points_from.resolve() if args.decode_points_from else None
    result = {**result_header({"validation": str(validation.relative_to(ROOT)),
                               "probes": [str(p.relative_to(ROOT)) for p in probes],
                               "mixed_step_grid": ", ".join(str(p.relative_to(ROOT))
                                                            for p in grid) or None,
                               "decode_points_from": engine and str(engine.relative_to(ROOT)),
                               "slo_order": args.slo_order,
                               "prefill_order_max_wait_ms": args.prefill_order_max_wait_ms}),
              **run(validation, probes, grid, args.steps, engine, args.slo_order, max_wait_s)}
    for name, probe in result["probes"].items():
        if "compare" in probe:
            errors = {key: {q: round(100 * e, 1) for q, e in
                            probe["compare"][key]["simulated_error"].items()}
                      for key in ("ttft_s", "tpot_s")}
            print(name, "attainment", probe["attainment"], "errors %", errors)
        else:
            print(name, f"({probe['schedule']}: steps only)")
        if probe.get("steps", {}).get("steps"):
            print_steps(probe["steps"])
    for name, reason in result["skipped"].items():
        print(name, "skipped:", reason)
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
