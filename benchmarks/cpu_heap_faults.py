"""glibc's heap and a CPU instance's decode: minor page faults per generated token and the
decode step, with glibc's defaults against the heap kept (``KEEP_HEAP_ENV``:
``MALLOC_MMAP_THRESHOLD_`` at its largest, ``MALLOC_TRIM_THRESHOLD_`` at 1 GiB), on fresh
``pdserve serve`` processes alternating between the two, one torch thread each::

    python benchmarks/cpu_heap_faults.py --out benchmarks/results/cpu_heap_faults_<rev>.json

Each round starts one server per setting (the tiny model, float32, on the CPU), warms it
with one answer, then streams ``--answers`` answers of ``--tokens`` tokens one after
another at each ``--contexts`` prompt length; the engine process's minor faults
(``/proc/<pid>/stat``) from each answer's first token to its last, per token after the
first (and up to its first token: the prompt's), the median TTFT, and the median gap
between streamed tokens past the first eight.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.validate_sim import KEEP_HEAP_ENV, VOCAB, token_clock  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.testing import start_serve  # noqa: E402

SETTINGS = {"glibc_defaults": {}, "heap_kept": KEEP_HEAP_ENV}
SKIPPED_TOKENS = 8  # the first tokens: the hand-back of the prompt's step, not decode


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt


def started(setting: str):
    """A server whose processes inherit ``setting``'s malloc variables (and nothing of the
    other's)."""
    env = {name: value for name, value in os.environ.items() if name not in KEEP_HEAP_ENV}
    return start_serve("tiny", "--dtype", "float32", "--device", "cpu",
                       env={**env, **SETTINGS[setting]})


async def measure(server, args, rng) -> dict:
    from aiohttp import ClientSession, ClientTimeout

    url = server.url + "/v1/completions"
    async with ClientSession(timeout=ClientTimeout(total=None)) as session:
        info = await (await session.get(server.url + "/v1/engine/info")).json()
        pid = info["engine_pid"]
        body = {"model": "tiny", "ignore_eos": True, "max_tokens": args.tokens}
        await token_clock(session, url, {**body, "prompt": [1] * 64})  # warm-up
        points = {}
        for context in args.contexts:
            faults, steps, prompt_faults, ttfts = 0, [], 0, []
            for _ in range(args.answers):
                marks, sent = [minor_faults(pid)], time.monotonic()
                times = await token_clock(
                    session, url, {**body, "prompt": rng.integers(0, VOCAB, context).tolist()},
                    on_first=lambda: marks.append(minor_faults(pid)))  # noqa: B023
                marks.append(minor_faults(pid))
                prompt_faults += marks[1] - marks[0]
                faults += marks[2] - marks[1]
                steps += np.diff(times[SKIPPED_TOKENS:]).tolist()
                ttfts.append(times[0] - sent)
            points[str(context)] = {
                "decode_faults_per_token": faults / (args.answers * (args.tokens - 1)),
                "prompt_faults": prompt_faults / args.answers,
                "ttft_ms_p50": float(np.median(ttfts)) * 1e3,
                "step_ms_p50": float(np.median(steps)) * 1e3}
        return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                        default=[128, 1024])
    parser.add_argument("--answers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(args.rounds):
        row = {}
        for setting in SETTINGS:  # alternating: the host's speed hits both alike
            server = started(setting)
            try:
                row[setting] = asyncio.run(measure(server, args, rng))
            finally:
                server.stop()
            time.sleep(1.0)
        rounds.append(row)
        print(row, flush=True)
    summary = {setting: {context: {key: float(np.median([r[setting][context][key]
                                                          for r in rounds]))
                                   for key in ("decode_faults_per_token", "prompt_faults",
                                               "ttft_ms_p50", "step_ms_p50")}
                         for context in map(str, args.contexts)}
               for setting in SETTINGS}
    config = {k: v for k, v in vars(args).items() if k != "out"}
    write_json({**result_header(config), "kind": "measurement", "settings": SETTINGS,
                "omp_num_threads": os.environ["OMP_NUM_THREADS"], "rounds": rounds,
                "median_over_rounds": summary}, args.out)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
