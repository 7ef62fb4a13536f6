"""Does a CPU engine's decode step slow down with what it has served? Two A/Bs on one
core, in one process, alternating so that the host's speed hits both sides alike:

- ``served``: a fresh engine against one that first served ``--churn`` requests of mixed
  prompt (64-1,024 tokens) and answer (16-64 tokens) lengths, probed alternately, the
  churned one serving a few more between rounds;
- ``pages``: one engine whose free KV pages are put in id order before one probe and
  shuffled before the next (a request's pages contiguous in memory or scattered);
- ``idle``: one engine probed right after another probe (back to back, as the
  calibration's streams run) and after ``--pause-s`` of nothing (as most of a replay's
  requests find the decode instance).

Each probe decodes one request of ``--context`` prompt tokens for 40 tokens; its figure is
the median decode step from the engine's step timeline. The tiny model in float32 on the
CPU, one torch thread, as ``validate_sim.py``'s instances run::

    python benchmarks/cpu_decode_state_ab.py --out cpu_decode_state_ab.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.report import result_header, write_json  # noqa: E402


def make_engine():
    from pdserve.engine.llm import LLM

    return LLM("tiny", device="cpu", dtype="float32", schedule="chunked",
               enable_prefix_caching=False)


def probe(llm, rng: random.Random, context: int) -> float:
    """The median decode step (ms) of one request of ``context`` prompt tokens."""
    from pdserve.sampling_params import SamplingParams

    since = time.monotonic()
    prompt = [rng.randrange(1, 250) for _ in range(context)]
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    return statistics.median(e["measured_cycle_ms"] for e in llm.engine.timeline(since)
                             if e["mode"] == "decode_only")


def churn(llm, rng: random.Random, requests: int) -> None:
    from pdserve.sampling_params import SamplingParams

    for _ in range(requests):
        prompt = [rng.randrange(1, 250) for _ in range(rng.choice([64, 256, 512, 1024]))]
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(max_tokens=rng.randint(16, 64), temperature=0,
                                    ignore_eos=True))


def served_ab(rng: random.Random, args) -> dict:
    fresh, churned = make_engine(), make_engine()
    churn(churned, rng, args.churn)
    rows = []
    for _ in range(args.rounds):
        rows.append({"fresh_ms": probe(fresh, rng, args.context),
                     "served_ms": probe(churned, rng, args.context)})
        churn(churned, rng, 5)
    return summarise(rows, "served_ms", "fresh_ms")


def pages_ab(rng: random.Random, args) -> dict:
    llm = make_engine()
    blocks = llm.engine.blocks
    rows = []
    for _ in range(args.rounds):
        row = {}
        for layout in ("contiguous", "shuffled"):
            ids = sorted(blocks.free_blocks)
            if layout == "shuffled":
                rng.shuffle(ids)
            blocks.free_blocks = OrderedDict((i, None) for i in ids)
            row[f"{layout}_ms"] = probe(llm, rng, args.context)
        rows.append(row)
    return summarise(rows, "shuffled_ms", "contiguous_ms")


def idle_ab(rng: random.Random, args) -> dict:
    llm = make_engine()
    rows = []
    for _ in range(args.rounds):
        probe(llm, rng, args.context)
        row = {"back_to_back_ms": probe(llm, rng, args.context)}
        time.sleep(args.pause_s)
        row["after_pause_ms"] = probe(llm, rng, args.context)
        rows.append(row)
    return summarise(rows, "after_pause_ms", "back_to_back_ms")


PARTS = {"served": served_ab, "pages": pages_ab, "idle": idle_ab}


def summarise(rows: list[dict], new: str, old: str) -> dict:
    ratios = [r[new] / r[old] for r in rows]
    return {"rounds": rows, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "new_over_old": f"{new} / {old}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--churn", type=int, default=80)
    parser.add_argument("--pause-s", type=float, default=2.0, help="the idle A/B's pause")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which A/Bs, comma-separated (of {', '.join(PARTS)})")
    parser.add_argument("--core", type=int, default=1, help="run on this core only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    import torch

    torch.set_num_threads(1)
    rng = random.Random(0)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: no A/B named {', '.join(sorted(unknown))}")
    result = {**result_header(vars(args) | {"out": args.out and str(args.out)}),
              "kind": "ab", **{name: PARTS[name](rng, args) for name in parts}}
    for name in parts:
        part = result[name]
        print(f"{name}: {part['new_over_old']} median {part['ratio_median']:.3f} "
              f"({part['ratio_min']:.3f}-{part['ratio_max']:.3f})")
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
