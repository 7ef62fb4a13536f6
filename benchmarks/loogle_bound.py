"""How fast prefill must run for a goodput probe's requests to meet their TTFT SLO, whatever
the schedule: a bound, not a measurement.

A probe sends fixed prompts at fixed arrival times (the records' prompt lengths; the arrival
process of ``pdserve.bench.arrivals`` rescaled to each rate). Take an ideal server that
prefills ``R`` prompt tokens a second, one prompt at a time or interleaved as it likes,
with decoding free. A set of requests can all have their first token within the SLO iff
preemptive earliest-deadline-first meets every deadline (Horn's condition: for each
arrival ``a_i`` and each deadline ``d_k``, the prompts arriving at or after ``a_i`` with
deadlines up to ``d_k`` fit in ``d_k - a_i``). The bound is the least ``R`` at which some
set of ``ceil(attainment x n)`` requests passes. A schedule that prefills slower than this,
on average over the probe, cannot reach the attainment at that rate; one that prefills
faster may still miss it (decode takes GPU time too).

    python benchmarks/loogle_bound.py \\
        --record benchmarks/results/goodput_h200/loogle__chunk256__r0.6.json \\
        --rates 0.5,0.6,0.65,0.7,0.8,0.9 --out benchmarks/results/loogle_prefill_bound.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout

from pdserve.bench.arrivals import gamma_arrivals  # noqa: E402
from pdserve.bench.report import result_header  # noqa: E402


def all_meet_deadlines(arrivals: np.ndarray, work_s: np.ndarray, slo_s: float) -> bool:
    """Horn's condition for one server, preemption allowed, deadlines ``arrival + slo_s``."""
    deadlines = arrivals + slo_s
    for start in arrivals:
        later = arrivals >= start
        order = np.argsort(deadlines[later], kind="stable")
        finished = np.cumsum(work_s[later][order])
        if np.any(finished > deadlines[later][order] - start + 1e-9):
            return False
    return True


def some_set_passes(arrivals: np.ndarray, tokens: np.ndarray, rate_tokens_s: float,
                    slo_s: float, passing: int) -> bool:
    """Whether ``passing`` of the requests can all meet the SLO at ``rate_tokens_s``."""
    work_s = tokens / rate_tokens_s
    for dropped in itertools.combinations(range(len(tokens)), len(tokens) - passing):
        kept = np.ones(len(tokens), bool)
        kept[list(dropped)] = False
        if all_meet_deadlines(arrivals[kept], work_s[kept], slo_s):
            return True
    return False


def least_prefill_rate(arrivals: list[float], tokens: list[int], slo_s: float,
                       attainment: float, tolerance: float = 1.0) -> float:
    """The least prefill rate (tokens/s, to ``tolerance``) at which ``attainment`` of the
    requests can meet the SLO."""
    arrivals_a, tokens_a = np.asarray(arrivals, float), np.asarray(tokens, float)
    passing = math.ceil(attainment * len(tokens) - 1e-9)
    low, high = 1.0, float(tokens_a.sum())  # everything at once within a second
    while high - low > tolerance:
        middle = (low + high) / 2
        if some_set_passes(arrivals_a, tokens_a, middle, slo_s, passing):
            high = middle
        else:
            low = middle
    return high


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True,
                        help="a goodput probe's JSON: its prompts (lengths, in send order)")
    parser.add_argument("--rates", default="0.5,0.6,0.65,0.7,0.8,0.9")
    parser.add_argument("--ttft-slo-s", type=float, default=15.0)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text())
    samples = sorted(record["samples"], key=lambda s: s["send_s"])
    tokens = [s["prompt_len"] for s in samples]
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        arrivals = gamma_arrivals(len(tokens), rate, seed=0)
        least = least_prefill_rate(arrivals, tokens, args.ttft_slo_s, args.attainment)
        rows.append({"rate": rate, "least_prefill_tokens_per_s": round(least)})
        print(f"{rate:5.2f} req/s: prefill >= {least:7.0f} tokens/s")
    config = {"record": args.record.as_posix(), "ttft_slo_s": args.ttft_slo_s,
              "attainment": args.attainment}
    result = {**result_header(config), "kind": "analysis", "prompts": len(tokens),
              "prompt_tokens": sum(tokens), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
