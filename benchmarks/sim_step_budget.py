"""What prefill can reach on a probe's requests while every step beside a decode stays
within an inter-token target: chunked prefill whose steps are sized to the target by a
perfect predictor, simulated with the chunked instance model the H200 validation fitted.
A simulation, not a measurement.

Every schedule on one GPU that meets TPOT <= T while prompts wait must keep the steps a
decode sees at about T on average; with mixed steps (one weight read for the prompt's
piece and the decodes, what multiplexing's mixed steps and chunked prefill run) filling
each step to T is the natural way to do that (not proven the best: a TPOT is a mean, and a
schedule may trade a short step for a long one). ``ChunkedInstanceSim(step_budget_s=T)``
does that with the model's own step times (no prediction error), and a step with nothing
decoding takes up to ``--budget-chunk`` tokens. Fixed chunk sizes are simulated beside it,
and each measured record given (``--measured``) is set beside, with a chunked one's own
requests simulated at its chunk size: how far the model is from the engine on this
workload.

``--attention-scales``: the same with the prompt pieces' attention (over their prefix and
among their own tokens) at that fraction of its fitted time: what faster attention kernels
would buy the budgeted steps::

    python benchmarks/sim_step_budget.py \\
        --validation benchmarks/results/sim_validate_instance_h200_6b7fcf7.json \\
        --mixed-step-grid benchmarks/results/mixed_step_grid_h200_wide_6b7fcf7.json \\
        --record benchmarks/results/goodput_h200/loogle__chunk1024__r0.5.json \\
        --measured benchmarks/results/loogle_h200/40a9906_chunk512_rate0.5_records.json ... \\
        --out benchmarks/results/sim_step_budget_loogle_r0.5.json

A record is a goodput probe's JSON (``samples``) or a ``loadgen_loogle.py`` result
(``requests``); the requests simulated are ``--record``'s (send times, prompt and answer
lengths). Per configuration: TTFT and TPOT P50 / P99, SLO attainment, the input
throughput as ``loadgen_loogle.py`` reports it (prompt tokens over the time to the last
answer's end), and the effective prefill rate (``loogle_bound.effective_prefill_rate``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout

from benchmarks.loogle_bound import effective_prefill_rate  # noqa: E402
from benchmarks.sim_goodput_probes import chunked_model  # noqa: E402
from benchmarks.sim_validate_instance import latency_rows  # noqa: E402
from benchmarks.validate_sim import percentiles  # noqa: E402
from pdserve.bench.arrivals import gamma_arrivals  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.config import PREFILL_ORDERS, check_prefill_order  # noqa: E402
from pdserve.sim.cluster import LatencyModel, ServiceNoise, SimRequest  # noqa: E402
from pdserve.sim.instance import ChunkedInstanceSim  # noqa: E402


def samples_of(record: dict) -> list[dict]:
    """A record's requests as goodput samples (send time, lengths, TTFT and TPOT in ms),
    in send order: a goodput probe's own, or a ``loadgen_loogle.py`` result's converted."""
    if "samples" in record:
        samples = record["samples"]
    else:
        samples = [{"send_s": r["sent_at"], "prompt_len": r["input_len"],
                    "output_tokens": r["output_len"], "ttft_ms": r["ttft"] * 1e3,
                    "tpot_ms": (r["e2e"] - r["ttft"]) / max(1, r["output_len"] - 1) * 1e3,
                    "e2e_ms": r["e2e"] * 1e3} for r in record["requests"] if r.get("ok")]
    return sorted(samples, key=lambda s: s["send_s"])


def chunk_size_of(record: dict) -> int | None:
    """The chunk size a measured record's server ran (None: another schedule): from its
    server flags, or for a ``loadgen_loogle.py`` result from the configuration name
    ``loogle_h200.py`` labels it with (``chunk512_0.5``)."""
    if "config" not in record:  # a loadgen_loogle.py result: loogle_h200.py's label
        found = re.match(r"chunk(\d+)_", record["summary"].get("label", ""))
        return int(found.group(1)) if found else None
    words = record["config"].get("server_args", "").split()
    if "--chunk-size" in words and "chunked" in words:
        return int(words[words.index("--chunk-size") + 1])
    return None


def figures(samples: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """P50 / P99 of TTFT and TPOT (s), attainment, input throughput and effective prefill
    rate of requests given as samples."""
    rows = [{"ttft_s": s["ttft_ms"] / 1e3, "tpot_s": s["tpot_ms"] / 1e3} for s in samples]
    end_s = max(s["send_s"] + s["e2e_ms"] / 1e3 for s in samples)
    return {**{key: percentiles(rows, key) for key in ("ttft_s", "tpot_s")},
            "attainment": sum(r["ttft_s"] <= ttft_slo_s and r["tpot_s"] <= tpot_slo_s
                              for r in rows) / len(rows),
            "input_throughput": sum(s["prompt_len"] for s in samples) / end_s,
            "effective_prefill_tokens_per_s": effective_prefill_rate({"samples": samples})}


def simulated_samples(model: LatencyModel, samples: list[dict], chunk: int, extra_s: float,
                      noise: ServiceNoise | None, budget_s: float | None = None,
                      order: dict | None = None) -> list[dict]:
    """The requests of ``samples`` through ``ChunkedInstanceSim`` (``order``: its
    ``prefill_order``, ``ttft_slo_s`` and ``max_wait_s``; none: first come, first served),
    back as samples."""
    requests = [SimRequest(s["send_s"], s["prompt_len"], s["output_tokens"]) for s in samples]
    ChunkedInstanceSim(model, chunk_size=chunk, noise=noise, mixed_step_extra_s=extra_s,
                       overlap=True, step_budget_s=budget_s, **(order or {})).run(requests)
    return [{"send_s": r.arrival, "prompt_len": r.input_len, "output_tokens": r.output_len,
             "ttft_ms": row["ttft_s"] * 1e3, "tpot_ms": row["tpot_s"] * 1e3,
             "e2e_ms": (r.finished - r.arrival) * 1e3}
            for r, row in zip(requests, latency_rows(requests), strict=True)]


def with_attention_scale(model: LatencyModel, scale: float) -> LatencyModel:
    """The model with the prompt pieces' attention terms at ``scale`` of their time."""
    return replace(model, prefill_per_token_sq_s=model.prefill_per_token_sq_s * scale,
                   mixed_prefix_per_pair_s=model.mixed_prefix_per_pair_s * scale,
                   mixed_prefix_floor_per_token_s=model.mixed_prefix_floor_per_token_s * scale)


def run(args: argparse.Namespace) -> dict:
    model, extra_s, noise, facts = chunked_model(
        args.validation.resolve(), [path.resolve() for path in args.mixed_step_grid])
    record = json.loads(args.record.read_text())
    samples = samples_of(record)
    if args.rates:
        check_rescalable(record, samples)
    slo = (args.ttft_slo_s, args.tpot_slo_ms / 1e3)
    order = prefill_order_of(args)

    def simulate(sim_model, requests, chunk, budget_s=None):
        both = {"medians_only": simulated_samples(sim_model, requests, chunk, extra_s, None,
                                                  budget_s, order),
                "with_spread": simulated_samples(sim_model, requests, chunk, extra_s,
                                                 noise, budget_s, order)}
        return {name: figures(rows, *slo) for name, rows in both.items()}

    configurations = []
    for rate in args.rates or [None]:
        at_rate = samples if rate is None else rescaled(samples, rate)
        for scale in args.attention_scales:
            scaled = with_attention_scale(model, scale)
            for chunk, budget_ms in [(chunk, None) for chunk in args.chunks] + [
                    (args.budget_chunk, budget_ms) for budget_ms in args.budgets_ms]:
                configurations.append({
                    "rate": rate, "attention_scale": scale, "chunk_size": chunk,
                    "step_budget_ms": budget_ms,
                    **simulate(scaled, at_rate, chunk, None if budget_ms is None
                               else budget_ms / 1e3)})
                print(f"rate {rate or 'as recorded'}, attention x{scale}, chunk {chunk}, "
                      f"budget {budget_ms} ms: {summary_line(configurations[-1]['with_spread'])}",
                      flush=True)
    measured = [measured_row(path, samples, model, slo, simulate) for path in args.measured]
    return {"kind": "simulation", "num_instances": 1, **facts,
            "requests_from": args.record.as_posix(), "requests": len(samples),
            "prompt_tokens": sum(s["prompt_len"] for s in samples),
            "slo": {"ttft_s": args.ttft_slo_s, "tpot_ms": args.tpot_slo_ms},
            "configurations": configurations, "measured": measured}


def prefill_order_of(args: argparse.Namespace) -> dict:
    """``ChunkedInstanceSim``'s order arguments for ``--prefill-order`` (the TTFT SLO is
    ``--ttft-slo-s``); a ValueError naming the problem as the engine's flags do."""
    max_wait_s = (None if args.prefill_order_max_wait_ms is None
                  else args.prefill_order_max_wait_ms / 1e3)
    check_prefill_order(args.prefill_order, args.ttft_slo_s * 1e3,
                        args.prefill_order_max_wait_ms)
    return {"prefill_order": args.prefill_order, "ttft_slo_s": args.ttft_slo_s,
            "max_wait_s": max_wait_s}


def check_rescalable(record: dict, samples: list[dict]) -> None:
    """Stop unless the record's requests were sent at the probes' arrivals for its rate (a
    synthetic workload: the same prompts at every rate). A trace window draws other requests
    at another rate, so its record says nothing of another rate's."""
    rate = (record.get("probe") or {}).get("rate")
    if rate is None:
        raise SystemExit("--rates needs a goodput probe's record (its rate)")
    sent = np.array([s["send_s"] for s in samples])
    if np.max(np.abs(sent - gamma_arrivals(len(samples), rate, seed=0))) > 0.05:
        raise SystemExit(f"--rates: {record['probe'].get('workload')} requests were not sent "
                         "at the probes' arrivals (a trace draws other requests at each "
                         "rate); give a record of the rate itself")


def rescaled(samples: list[dict], rate: float) -> list[dict]:
    """The same prompts sent at ``rate``: the goodput probes' arrival process
    (``gamma_arrivals``, seed 0), as ``goodput_h200.py`` sends a probe at each rate."""
    arrivals = gamma_arrivals(len(samples), rate, seed=0)
    return [{**s, "send_s": float(a)} for s, a in zip(samples, arrivals, strict=True)]


def measured_row(path: Path, samples: list[dict], model, slo, simulate) -> dict:
    """A measured record's figures and, for a chunked server, its chunk size simulated on
    the record's own requests (``same_prompts``: whether they are ``--record``'s prompts)."""
    record = json.loads(path.read_text())
    own = samples_of(record)
    row = {"record": path.as_posix(), "git_revision": record.get("git_revision"),
           "server_args": (record.get("config") or {}).get("server_args"),
           "same_prompts": [s["prompt_len"] for s in own] == [s["prompt_len"] for s in samples],
           "measured": figures(own, *slo)}
    chunk = chunk_size_of(record)
    if chunk is not None:
        row["simulated"] = simulate(model, own, chunk)
    print(f"{path.name}: {summary_line(row['measured'])}", flush=True)
    return row


def summary_line(found: dict) -> str:
    return (f"TTFT p50 {found['ttft_s']['p50']:.1f} s, TPOT p99 {found['tpot_s']['p99'] * 1e3:.0f}"
            f" ms, {found['input_throughput']:.0f} tokens/s in "
            f"({found['effective_prefill_tokens_per_s']:.0f} effective), "
            f"{found['attainment']:.0%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validation", type=Path, required=True,
                        help="a sim_validate_instance.py result whose chunk512 fit to use")
    parser.add_argument("--mixed-step-grid", type=Path, nargs="*", default=[],
                        help="bench_mixed_step.py --grid results: the grid terms")
    parser.add_argument("--record", type=Path, required=True,
                        help="the requests to simulate (a goodput probe or loadgen result)")
    parser.add_argument("--measured", type=Path, nargs="*", default=[],
                        help="measured records of the same requests, set beside")
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[256, 512, 1024], help="fixed chunk sizes ('' for none)")
    parser.add_argument("--budgets-ms", type=lambda s: [float(x) for x in s.split(",") if x],
                        default=[40.0, 60.0, 80.0, 100.0], help="step budgets ('' for none)")
    parser.add_argument("--budget-chunk", type=int, default=2048,
                        help="the most prompt tokens a budgeted step takes")
    parser.add_argument("--attention-scales", type=lambda s: [float(x) for x in s.split(",")],
                        default=[1.0])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        help="simulate the record's prompts sent at each of these rates "
                        "(the goodput probes' arrivals) instead of at its own send times; "
                        "a synthetic workload's probe only (a trace draws other requests "
                        "at each rate)")
    parser.add_argument("--ttft-slo-s", type=float, default=15.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=60.0)
    parser.add_argument("--prefill-order", choices=PREFILL_ORDERS, default="fcfs",
                        help="the engine's flag of that name: slo serves the prompts that "
                        "can make --ttft-slo-s first (every configuration, measured rows "
                        "simulated alike)")
    parser.add_argument("--prefill-order-max-wait-ms", type=float,
                        help="with --prefill-order slo: the engine's wait bound")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        prefill_order_of(args)
    except ValueError as error:
        parser.error(str(error))
    config = json.loads(json.dumps(vars(args), default=str))  # the paths as given
    write_json({**result_header(config), **run(args)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
