"""Does a CPU engine's decode step slow down with what it has served? Two A/Bs on one
core, in one process, alternating so that the host's speed hits both sides alike:

- ``served``: a fresh engine against one that first served ``--churn`` requests of mixed
  prompt (64-1,024 tokens) and answer (16-64 tokens) lengths, probed alternately, the
  churned one serving a few more between rounds;
- ``pages``: one engine whose free KV pages are put in id order before one probe and
  shuffled before the next (a request's pages contiguous in memory or scattered);
- ``idle``: one engine probed right after another probe (back to back, as the
  calibration's streams run) and after ``--pause-s`` of nothing (as most of a replay's
  requests find the decode instance);
- ``pd_served``: what ``validate_sim.py`` runs, twice: two P/D groups of served tiny
  instances (``pdserve serve``, each group's prefill instance on the first core, its
  decode instance on ``--core``) behind the real gateway, one group fresh and one that
  first served ``--churn`` requests through its gateway (more between rounds), probed
  alternately through their gateways, each probe's figures its prompt's prefill on the
  prefill instance and its decode instance's median decode step, from those servers'
  step timelines. The in-process A/Bs leave out the
  server: its HTTP side, the KV hand-off and everything a served request leaves behind.

Each probe decodes one request of ``--context`` prompt tokens for 40 tokens; its figure is
the median decode step from the engine's step timeline. The tiny model in float32 on the
CPU, one torch thread, as ``validate_sim.py``'s instances run::

    python benchmarks/cpu_decode_state_ab.py --out cpu_decode_state_ab.json
"""

from __future__ import annotations

import argparse
import asyncio
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
        churn(churned, rng, args.churn_between_rounds)
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


def pd_served_ab(rng: random.Random, args) -> dict:
    """The gateways and this client on any core, as in ``validate_sim.py``; the instances
    pinned by ``start_instance``."""
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, args.host_cores)
    try:
        return asyncio.run(_pd_served_ab(rng, args))
    finally:
        os.sched_setaffinity(0, pinned)


async def _pd_served_ab(rng: random.Random, args) -> dict:
    from aiohttp import ClientSession, ClientTimeout

    from benchmarks import validate_sim
    from pdserve.cluster.app import stop_gateway

    group_args = argparse.Namespace(model="tiny", serve_args="--dtype float32 --device cpu",
                                    ttft_slo_s=30.0, max_wait_s=30.0)
    servers, gateways = [], []
    try:
        async with ClientSession(timeout=ClientTimeout(total=None)) as session:
            groups = []
            # both groups' instances started at once (a start is mostly loading torch)
            servers = await asyncio.to_thread(validate_sim.start_instances, group_args,
                                              [{args.prefill_core}, {args.core}] * 2)
            for pair in (servers[:2], servers[2:]):
                gateway, url = await validate_sim.start_group(session, *pair, group_args)
                gateways.append(gateway)
                groups.append((url, *pair))
            await served_churn(session, groups[1][0], rng, args.churn)
            rows: dict[str, list[dict]] = {"decode": [], "prefill": []}
            for k in range(args.rounds):
                probed = {}
                for side in ("fresh", "served")[::1 if k % 2 else -1]:  # each first in turn
                    probed[side] = await served_probe(
                        session, *groups[side == "served"], rng, args)
                for part, part_rows in rows.items():
                    part_rows.append({f"{side}_ms": probed[side][part] for side in probed})
                await served_churn(session, groups[1][0], rng, args.churn_between_rounds)
    finally:
        for gateway in gateways:
            await stop_gateway(*gateway)
        for server in servers:
            server.stop()
    return {part: summarise(part_rows, "served_ms", "fresh_ms")
            for part, part_rows in rows.items()}


async def served_churn(session, url: str, rng: random.Random, requests: int) -> None:
    for _ in range(requests):
        body = {"model": "tiny", "max_tokens": rng.randint(16, 64), "ignore_eos": True,
                "prompt": [rng.randrange(1, 250)
                           for _ in range(rng.choice([64, 256, 512, 1024]))]}
        async with session.post(url, json=body) as resp:
            await resp.read()


async def served_probe(session, url: str, prefill, decode, rng: random.Random,
                       args) -> dict[str, float]:
    """One request through a group's gateway: its prompt's prefill (ms, the prefill
    instance's steps that carried it) and its median decode step (ms, the decode
    instance's), from the servers' step timelines."""
    from benchmarks import validate_sim

    since = time.monotonic()
    body = {"model": "tiny", "max_tokens": 40, "ignore_eos": True,
            "prompt": [rng.randrange(1, 250) for _ in range(args.context)]}
    async with session.post(url, json=body) as resp:
        await resp.read()
    prefilled, decoded = [validate_sim.step_rows(await validate_sim.instance_steps(
        session, server, since)) for server in (prefill, decode)]
    return {"prefill": sum(r["measured_cycle_ms"] for r in prefilled if r["prefill_tokens"]),
            "decode": statistics.median(r["measured_cycle_ms"] for r in decoded
                                        if r["mode"] == "decode_only")}


PARTS = {"served": served_ab, "pages": pages_ab, "idle": idle_ab, "pd_served": pd_served_ab}


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
    parser.add_argument("--churn-between-rounds", type=int, default=5,
                        help="requests served by the churned side between two rounds")
    parser.add_argument("--pause-s", type=float, default=2.0, help="the idle A/B's pause")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which A/Bs, comma-separated (of {', '.join(PARTS)})")
    parser.add_argument("--core", type=int, default=1, help="run on this core only")
    parser.add_argument("--prefill-core", type=int, default=0,
                        help="pd_served: the prefill instances' core")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.host_cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.core})
    import torch

    torch.set_num_threads(1)
    rng = random.Random(0)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: no A/B named {', '.join(sorted(unknown))}")
    config = {k: v for k, v in vars(args).items() if k != "host_cores"}
    result = {**result_header(config | {"out": args.out and str(args.out)}),
              "kind": "ab", **{name: PARTS[name](rng, args) for name in parts}}
    for name in parts:
        for label, part in ({name: result[name]} if "rounds" in result[name] else
                            {f"{name} {k}": v for k, v in result[name].items()}).items():
            print(f"{label}: {part['new_over_old']} median {part['ratio_median']:.3f} "
                  f"({part['ratio_min']:.3f}-{part['ratio_max']:.3f})")
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
