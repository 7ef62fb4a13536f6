"""First come, first served against the SLO-aware admission order (``--prefill-order slo``)
on recorded probes' arrivals and prompts (offline, no GPU).

A single-server queue model: each probe's requests arrive at their recorded send times and
their prompts are prefilled one after another, whole, at one rate; a request meets the TTFT
SLO when its prefill ends within the SLO of its arrival. The rate is taken from the record:
a request's TTFT holds at least its own prefill, so prompt tokens over TTFT is at most the
rate; the ``--rate-quantile`` of that ratio over the probe's requests (default: the 90th
percentile) stands for the rate of a prompt that did not wait. Decode steps, chunk
interleaving and prefix hits are not modelled: the model's FCFS attainment is printed beside
the recorded one to show how far it is from the GPU run. It estimates what the order alone
could change (``"kind": "offline queue model"``); it is not a GPU result.

``--prefill-rate`` sets the rate instead (tokens/s, e.g. a configuration's effective rate from
``loogle_bound.py``), and ``--arrival-rates`` replays the same requests with their send times
rescaled to each rate (req/s), as the goodput ladder's probes of one workload are.

    python benchmarks/slo_order_replay.py \\
        benchmarks/results/goodput_h200/mooncake__chunk256__r0.5.json [more records]
    python benchmarks/slo_order_replay.py --prefill-rate 5840 --arrival-rates 0.65,0.7,0.75 \\
        benchmarks/results/goodput_h200/loogle__chunk256__r0.65.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from pdserve.sched.prefill_order import slo_rank  # noqa: E402


def replay(arrivals: list[float], services: list[float], slo_s: float, order: str) -> int:
    """Requests whose prefill ends within ``slo_s`` of arrival, served whole one at a time
    from a queue kept in ``order`` (``fcfs`` or ``slo``)."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    waiting: list[int] = []
    now, met = 0.0, 0
    while pending or waiting:
        if not waiting:
            now = max(now, arrivals[pending[0]])
        while pending and arrivals[pending[0]] <= now:
            waiting.append(pending.pop(0))
        chosen = waiting[0] if order == "fcfs" else _slo_first(waiting, arrivals, services,
                                                               slo_s, now)
        waiting.remove(chosen)
        now += services[chosen]
        met += now - arrivals[chosen] <= slo_s
    return met


def _slo_first(waiting: list[int], arrivals: list[float], services: list[float],
               slo_s: float, now: float) -> int:
    ranked, _ = slo_rank([(arrivals[i], services[i]) for i in waiting], now, slo_s)
    return waiting[ranked[0]]


def estimate(record: dict, quantile: float, prefill_rate: float | None = None,
             arrival_rate: float | None = None) -> dict:
    """The model on ``record``'s requests: at ``prefill_rate`` (else the ``quantile`` of
    prompt tokens over TTFT), with the send times rescaled to ``arrival_rate`` (req/s) if
    given. Recorded attainment is printed only for the probe's own arrival rate."""
    samples = [s for s in record["samples"] if s["success"]]
    slo_s = record["workload"]["definition"]["ttft_slo_ms"] / 1e3
    ratios = sorted(s["prompt_len"] / (s["ttft_ms"] / 1e3) for s in samples)
    rate = prefill_rate or ratios[min(len(ratios) - 1, int(quantile * len(ratios)))]
    probed = record["probe"]["rate"]
    stretch = 1.0 if arrival_rate is None else probed / arrival_rate
    arrivals = [s["send_s"] * stretch for s in samples]
    services = [s["prompt_len"] / rate for s in samples]
    count = len(samples)
    rescaled = arrival_rate is not None and arrival_rate != probed
    recorded = sum(s["ttft_ms"] <= slo_s * 1e3 for s in samples) / count
    return {"kind": "offline queue model", "probe": record["probe"],
            "arrival_rate": arrival_rate or probed, "requests": count,
            "rate_tokens_per_s": round(rate), "rate_from": "given" if prefill_rate else
            f"quantile {quantile:g} of prompt tokens over TTFT", "ttft_slo_s": slo_s,
            "recorded_ttft_attainment": None if rescaled else round(recorded, 3),
            "model_fcfs_ttft_attainment": round(replay(arrivals, services, slo_s, "fcfs")
                                                / count, 3),
            "model_slo_ttft_attainment": round(replay(arrivals, services, slo_s, "slo")
                                               / count, 3),
            "median_prompt_tokens": statistics.median(s["prompt_len"] for s in samples)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="goodput_h200 probe records")
    parser.add_argument("--rate-quantile", type=float, default=0.9,
                        help="quantile of prompt tokens over TTFT taken as the prefill rate")
    parser.add_argument("--prefill-rate", type=float,
                        help="prefill rate in prompt tokens/s (instead of the quantile's)")
    parser.add_argument("--arrival-rates", type=_rates, default=[None],
                        help="comma-separated req/s to rescale the send times to "
                             "(default: the probe's own)")
    args = parser.parse_args(argv)
    if not 0.0 < args.rate_quantile <= 1.0:
        parser.error(f"--rate-quantile {args.rate_quantile}: must be in (0, 1]")
    if args.prefill_rate is not None and args.prefill_rate <= 0.0:
        parser.error(f"--prefill-rate {args.prefill_rate:g}: must be positive")
    for path in args.records:
        record = json.loads(path.read_text())
        for arrival_rate in args.arrival_rates:
            print(json.dumps(estimate(record, args.rate_quantile, args.prefill_rate,
                                      arrival_rate)))


def _rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or min(rates) <= 0.0:
        raise argparse.ArgumentTypeError(f"{text!r}: positive req/s, comma-separated")
    return rates


if __name__ == "__main__":
    main()
