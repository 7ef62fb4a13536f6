"""A host speed meter: on one core, a fixed piece of single-threaded CPU work (small torch
matrix products, a Python loop, an elementwise pass over 1 MiB), timed every ``--period-s``,
one JSON line ``[time.monotonic(), milliseconds]`` per sample.

``validate_sim.py`` runs one beside each instance on that instance's core: the instances'
own times say how fast they served, the meter how fast the host ran meanwhile, measured
apart from them (about 2 ms of work every 0.5 s, 0.4% of the core). A run whose instances
slowed while the meter did not slowed for a reason of its own::

    python benchmarks/host_meter.py --core 1 --period-s 0.5 --out meter.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=int, help="run on this core only (default: any)")
    parser.add_argument("--period-s", type=float, default=0.5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    import torch

    torch.set_num_threads(1)
    work = meter_work(torch)
    for _ in range(20):  # warm: the first calls allocate and fault pages in
        work()
    with open(args.out, "w") as out:
        while True:
            start = time.perf_counter()
            work()
            out.write(json.dumps([time.monotonic(), (time.perf_counter() - start) * 1e3]) + "\n")
            out.flush()
            time.sleep(args.period_s)


def meter_work(torch):
    """The timed work: what a tiny model's step on a CPU is made of, in small amounts."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, generator=generator)
    weight = torch.randn(256, 256, generator=generator) / 16
    block = torch.randn(64, 4096, generator=generator)

    def work() -> float:
        y = x
        for _ in range(100):
            y = (y @ weight).tanh()
        total = 0
        for i in range(20_000):
            total += i * i
        return float((block * 1.0001).sum()) + total

    return work


if __name__ == "__main__":
    raise SystemExit(main())
