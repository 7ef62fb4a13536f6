"""How long a step's outputs take from the engine loop to the HTTP process's end of the
channel, while the engine loop keeps running Python (as it does when it plans the next step).

The engine side is ``EngineChannel`` in this process, its loop a thread-free busy loop of
pure Python that sends one small message per "step"; the reading end is a separate process
that stamps each frame when it reads it. Both read ``time.monotonic()``, which processes on
one host share. Usage:

    python benchmarks/bench_engine_hop.py [--steps 2000] [--step-ms 1.0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import struct
import sys
import time

from pdserve.server.channel import EngineChannel


def read_frames(reader, count: int, results) -> None:
    """The server's side: stamps every frame's arrival against the send time it carries."""
    delays = []
    while len(delays) < count:
        for message in pickle.loads(reader.recv_bytes()):
            delays.append((time.monotonic() - message[0]) * 1e3)
    results.put(delays)


def busy_python(seconds: float) -> None:
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(range(50))  # holds the GIL, as a step's planning does


def run(steps: int, step_ms: float) -> list[float]:
    ctx = mp.get_context("spawn")
    to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
    from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
    results = ctx.Queue()
    reader = ctx.Process(target=read_frames, args=(from_engine_r, steps, results))
    reader.start()
    channel = EngineChannel(to_engine_r, from_engine_w)
    payload = [struct.pack("!q", i) * 8 for i in range(64)]  # about a 64-request step
    for _ in range(steps):
        channel.send((time.monotonic(), payload))
        busy_python(step_ms / 1e3)
    delays = results.get()
    reader.join()
    channel.close()
    to_engine_w.close()
    return delays


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=1.0,
                        help="Pure-Python work of the engine loop between two sends.")
    parser.add_argument("--out", help="Write the result here as JSON.")
    args = parser.parse_args(argv)
    delays = run(args.steps, args.step_ms)
    summary = {"mean": statistics.fmean(delays), "p50": percentile(delays, 50),
               "p90": percentile(delays, 90), "p99": percentile(delays, 99),
               "count": len(delays)}
    print("engine send -> server read (ms): " +
          " ".join(f"{k} {v:.3f}" for k, v in summary.items() if k != "count"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "hop_ms": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
