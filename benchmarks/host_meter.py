"""A host speed meter: on one core, a fixed piece of single-threaded CPU work (small torch
matrix products, a Python loop, an elementwise pass over 1 MiB), and apart from it a read
of a ``--cache-mib`` buffer, each timed every ``--period-s``: one JSON line
``[time.monotonic(), core milliseconds, cache milliseconds]`` per sample.

``validate_sim.py`` runs one beside each instance on that instance's core: the instances'
own times say how fast they served, the meter how fast the host ran meanwhile, measured
apart from them (about 3 ms of work every 0.5 s, 0.6% of the core). The core work stays
in the core's own caches; the buffer is sized like the tiny model's working set (its
weights are about 10 MiB in float32), which lives in the last-level cache that the
core shares with whatever else runs on the machine, so a step that slows because that
cache or the memory behind it is contended slows the second figure, not the first::

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
    parser.add_argument("--cache-mib", type=float, default=12.0,
                        help="the buffer read for the second figure (0: no second figure)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    import torch

    torch.set_num_threads(1)
    work, read = meter_work(torch), cache_read(torch, args.cache_mib)
    for _ in range(20):  # warm: the first calls allocate and fault pages in
        work()
        read()
    with open(args.out, "w") as out:
        while True:
            sample = [time.monotonic(), timed_ms(work)]
            if args.cache_mib > 0:
                sample.append(timed_ms(read))
            out.write(json.dumps(sample) + "\n")
            out.flush()
            time.sleep(args.period_s)


def timed_ms(work) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1e3


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


def cache_read(torch, mib: float):
    """A read of a ``mib`` buffer (a sum over it): its time follows how fast the shared
    cache, or the memory behind it, serves this core."""
    buffer = torch.ones(max(1, int(mib * 2**20 / 4)), dtype=torch.float32)
    return lambda: float(buffer.sum())


if __name__ == "__main__":
    raise SystemExit(main())
