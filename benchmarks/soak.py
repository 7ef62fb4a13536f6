"""Soak test of one `pdserve serve`: N minutes of mixed traffic, then what it left behind.

Clients run closed loops of four kinds of requests, picked at random: streamed to the end,
not streamed, streamed then dropped by the client after a few chunks (an abort), and not
streamed with the client hanging up before the answer (a disconnect). Every few seconds it
samples the server's /metrics and the resident memory of the server and engine processes,
with the latency of the requests that finished since the last sample. At the end it waits
until the engine is idle and counts KV pages not back in the free pool (pages leaked).

    python benchmarks/soak.py --minutes 5 --out soak.json --label "CPU host" -- \\
        tiny --dtype float32 --device cpu

Not part of the test suite: it runs for minutes by design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from bench_server_overhead import start_server, stop_server

from pdserve.bench.report import revision_fields

# CPU thread pools of the server's engine (inherited when this script starts it): on a
# small shared host they decide whether the engine keeps pace (docs/reliability.md).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
KINDS = ("stream", "plain", "abort", "disconnect")
WEIGHTS = (0.4, 0.3, 0.15, 0.15)


@dataclass
class Book:
    """What the clients saw: outcomes, and latencies of the window being sampled."""

    outcomes: Counter = field(default_factory=Counter)
    window_e2e: list[float] = field(default_factory=list)
    window_ttft: list[float] = field(default_factory=list)
    all_e2e: list[float] = field(default_factory=list)

    def done(self, kind: str, outcome: str, e2e: float | None = None) -> None:
        self.outcomes[kind, outcome] += 1
        if e2e is not None:
            self.window_e2e.append(e2e)
            self.all_e2e.append(e2e)


# ---- traffic ------------------------------------------------------------------------------


def _body(rng: random.Random, max_tokens: int, stream: bool) -> dict:
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "soak"])
                     for _ in range(rng.randint(1, 60)))
    return {"model": "tiny", "prompt": words, "max_tokens": rng.randint(1, max_tokens),
            "ignore_eos": True, "stream": stream}


async def _streamed(session, url: str, body: dict, book: Book, drop_after: int | None) -> None:
    start = time.monotonic()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            book.done("abort" if drop_after else "stream", f"http_{resp.status}")
            return
        chunks = 0
        async for line in resp.content:
            if not line.strip():
                continue
            chunks += 1
            if chunks == 1:
                book.window_ttft.append(time.monotonic() - start)
            if drop_after is not None and chunks >= drop_after:
                resp.close()  # the connection goes, mid-stream: the server must abort
                book.done("abort", "dropped_by_client")
                return
            if line.strip() == b"data: [DONE]":
                book.done("stream", "completed", time.monotonic() - start)
                return
            if b'"error"' in line:
                book.done("abort" if drop_after else "stream", "error_event")
                return
    book.done("abort" if drop_after else "stream", "lost")  # ended without [DONE]


async def _plain(session, url: str, body: dict, book: Book, hang_up_s: float | None) -> None:
    start = time.monotonic()
    kind = "disconnect" if hang_up_s is not None else "plain"
    try:
        async with asyncio.timeout(hang_up_s):
            async with session.post(url, json=body) as resp:
                payload = await resp.read()
    except TimeoutError:
        book.done(kind, "hung_up_by_client")
        return
    if resp.status == 200 and json.loads(payload)["choices"]:
        book.done(kind, "completed", time.monotonic() - start)
    else:
        book.done(kind, f"http_{resp.status}")


async def _client(base: str, args: argparse.Namespace, seed: int, book: Book,
                  stop_at: float) -> None:
    rng = random.Random(seed)
    url = base + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                await _one(session, url, kind, rng, args.max_tokens, book)
            except aiohttp.ClientError as exc:
                book.done(kind, f"client_error:{type(exc).__name__}")


async def _one(session, url: str, kind: str, rng: random.Random, max_tokens: int,
               book: Book) -> None:
    if kind == "stream":
        await _streamed(session, url, _body(rng, max_tokens, True), book, None)
    elif kind == "abort":
        await _streamed(session, url, _body(rng, max_tokens, True), book, rng.randint(2, 6))
    elif kind == "plain":
        await _plain(session, url, _body(rng, max_tokens, False), book, None)
    else:
        await _plain(session, url, _body(rng, max_tokens, False), book, rng.uniform(0.01, 0.3))


# ---- sampling -----------------------------------------------------------------------------


async def _metrics(session, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line.startswith("pdserve_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _engine_pid(server_pid: int | None) -> int | None:
    """The server's engine process: its multiprocessing spawn child."""
    if server_pid is None:
        return None
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == server_pid and spawned:
            return int(entry)
    return None


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "n": len(values)}


async def _sample(session, base: str, server_pid: int | None, book: Book, start: float
                  ) -> dict:
    metrics = await _metrics(session, base)
    engine = _engine_pid(server_pid)
    sample = {"t_s": round(time.monotonic() - start, 1),
              "running": metrics.get("pdserve_num_requests_running"),
              "waiting": metrics.get("pdserve_num_requests_waiting"),
              "free_blocks": metrics.get("pdserve_kv_cache_free_blocks"),
              "server_rss_mib": _rss_mib(server_pid), "engine_pid": engine,
              "engine_rss_mib": _rss_mib(engine), "e2e_s": _quantiles(book.window_e2e),
              # Latency on a shared host follows its load: kept next to it.
              "host_load_1m": os.getloadavg()[0],
              "ttft_s": _quantiles(book.window_ttft)}
    book.window_e2e.clear()
    book.window_ttft.clear()
    return sample


async def _sampler(base: str, server_pid: int | None, book: Book, period_s: float,
                   start: float, stop_at: float, samples: list[dict]) -> None:
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            await asyncio.sleep(period_s)
            samples.append(await _sample(session, base, server_pid, book, start))
            print(json.dumps(samples[-1]), flush=True)


async def _idle_free_blocks(base: str, timeout_s: float = 120) -> float:
    """Free KV pages once nothing runs or waits and the cache usage reads 0 (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            m = await _metrics(session, base)
            idle = m["pdserve_num_requests_running"] == m["pdserve_num_requests_waiting"] == 0
            if (idle and m["pdserve_kv_cache_usage_ratio"] == 0) or \
                    time.monotonic() > deadline:
                return m["pdserve_kv_cache_free_blocks"]
            await asyncio.sleep(0.5)


async def soak(base: str, server_pid: int | None, args: argparse.Namespace) -> dict:
    async with aiohttp.ClientSession() as session:  # the engine reports its pool once it ran
        await _plain(session, base + "/v1/completions", _body(random.Random(0), 2, False),
                     Book(), None)
    free_before = await _idle_free_blocks(base)
    book, samples = Book(), []
    start = time.monotonic()
    stop_at = start + args.minutes * 60
    clients = [_client(base, args, args.seed + i, book, stop_at)
               for i in range(args.concurrency)]
    await asyncio.gather(_sampler(base, server_pid, book, args.sample_s, start, stop_at,
                                  samples), *clients)
    free_after = await _idle_free_blocks(base)
    return {"free_blocks_before": free_before, "free_blocks_after": free_after,
            "pages_leaked": free_before - free_after, "traffic_s": time.monotonic() - start,
            "outcomes": {f"{k}/{o}": n for (k, o), n in sorted(book.outcomes.items())},
            "requests_sent": sum(book.outcomes.values()),
            "e2e_s_completed": _quantiles(book.all_e2e), "samples": samples,
            "rss_mib": _rss_summary(samples)}


def _rss_summary(samples: list[dict]) -> dict:
    out = {}
    for name in ("server_rss_mib", "engine_rss_mib"):
        values = [s[name] for s in samples if s[name] is not None]
        if values:
            out[name] = {"first": values[0], "last": values[-1], "max": max(values)}
    return out


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="A running server instead of starting one (its memory "
                        "is sampled only with --server-pid).")
    parser.add_argument("--server-pid", type=int, help="With --url: the server's process id.")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="Write the record here as JSON.")
    parser.add_argument("--label", default="", help="Free text saved with --out (the host).")
    parser.add_argument("serve_flags", nargs="*", help="After --: pdserve serve's arguments.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process = None
    if args.url:
        base, server_pid = args.url.rstrip("/"), args.server_pid
    else:
        process, base = start_server(args.serve_flags or ["tiny"])
        server_pid = process.pid
    try:
        result = asyncio.run(soak(base, server_pid, args))
    finally:
        if process is not None:
            stop_server(process)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.out:
        command = ["python", "benchmarks/soak.py", *(sys.argv[1:] if argv is None else argv)]
        record = {"command": shlex.join(command), **revision_fields(),
                  "label": args.label, "python": platform.python_version(),
                  "cpu_count": os.cpu_count(), "args": vars(args),
                  "env": {name: os.environ.get(name) for name in THREAD_ENV}, **result}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
