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
        --rates 0.5,0.6,0.65,0.7,0.75,0.8,0.9 --effective-from <probe records> \
        --out benchmarks/results/loogle_prefill_bound.json

``--effective-from``: for each probe record, the rate at which a server prefilling whole
prompts in arrival order comes closest to its measured first tokens, and what that server
attains at each rate on the bound's prompts: the simplest model of a schedule that keeps
its prefill rate as the load grows (its decode does not: it is the same 64 tokens a
request at any rate).
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


def fcfs_ttft_s(arrivals: list[float], tokens: list[int], rate_tokens_s: float) -> np.ndarray:
    """First-token times of a server that prefills whole prompts in arrival order at
    ``rate_tokens_s`` (decode free)."""
    finish, ttft = 0.0, []
    for arrival, prompt in zip(arrivals, tokens, strict=True):
        finish = max(finish, arrival) + prompt / rate_tokens_s
        ttft.append(finish - arrival)
    return np.asarray(ttft)


def effective_prefill_rate(record: dict) -> float:
    """The rate (tokens/s, to 10) at which ``fcfs_ttft_s`` comes closest to a probe's
    measured first-token times (least squares): how fast the schedule prefilled, queueing
    included, under the simplest model of it."""
    samples = sorted(record["samples"], key=lambda s: s["send_s"])
    arrivals = [s["send_s"] for s in samples]
    tokens = [s["prompt_len"] for s in samples]
    measured = np.asarray([s["ttft_ms"] / 1e3 for s in samples])
    return float(min(range(1000, 20000, 10), key=lambda rate: float(
        np.sum((fcfs_ttft_s(arrivals, tokens, rate) - measured) ** 2))))


def effective_row(path: Path, tokens: list[int], args: argparse.Namespace) -> dict:
    """A record's effective prefill rate and what a server at it attains at ``--rates``
    (the probe's prompts of ``--record``)."""
    record = json.loads(path.read_text())
    rate_tokens_s = effective_prefill_rate(record)
    attained = {}
    for rate in (float(r) for r in args.rates.split(",")):
        ttft = fcfs_ttft_s(gamma_arrivals(len(tokens), rate, seed=0), tokens, rate_tokens_s)
        attained[str(rate)] = round(float(np.mean(ttft <= args.ttft_slo_s)), 4)
    print(f"{path.name}: {rate_tokens_s:.0f} tokens/s; in arrival order {attained}")
    return {"record": path.as_posix(), "git_revision": record.get("git_revision"),
            "probe": record.get("probe"), "effective_prefill_tokens_per_s": rate_tokens_s,
            "fcfs_attainment_by_rate": attained}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True,
                        help="a goodput probe's JSON: its prompts (lengths, in send order)")
    parser.add_argument("--rates", default="0.5,0.6,0.65,0.7,0.8,0.9")
    parser.add_argument("--ttft-slo-s", type=float, default=15.0)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--effective-from", type=Path, nargs="*", default=[],
                        help="probe records: each one's effective prefill rate and the "
                        "attainment a server at that rate, in arrival order, reaches at "
                        "each rate")
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
    effective = [effective_row(path, tokens, args) for path in args.effective_from]
    config = {"record": args.record.as_posix(), "ttft_slo_s": args.ttft_slo_s,
              "attainment": args.attainment}
    result = {**result_header(config), "kind": "analysis", "prompts": len(tokens),
              "prompt_tokens": sum(tokens), "rows": rows,
              "effective": effective}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
