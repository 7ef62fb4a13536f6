"""How much latency the HTTP server adds on top of the engine.

N concurrent streaming clients (closed loop) ask a ``pdserve serve`` process on this host
for completions with the ``return_engine_timing`` extension, so every SSE chunk carries the
engine-side time of its tokens. Both sides read the host's monotonic clock, so per request
and per token we get:

- TTFT overhead = client TTFT (send -> first chunk received) - engine TTFT (engine received
  the request -> first token ready), split into inbound (send -> engine received; itself
  split at the server's arrival stamp into HTTP: send -> request parsed and tokenized, and
  channel: that stamp -> engine received) and outbound (first token ready -> first chunk
  received; itself split where the HTTP process read the token into channel: token ready ->
  read, and HTTP: read -> chunk received);
- ITL overhead = client gap between two chunks - engine gap between their tokens;
- delivery delay = chunk received - its tokens ready in the engine;
- the HTTP processes' CPU time per chunk (when the benchmark starts the server), summed
  over all of them with ``--api-server-count`` N > 1: what each streamed token costs the
  event loops that also take new requests.

Usage (starts its own server on the tiny model unless --url is given):

    python benchmarks/bench_server_overhead.py --concurrency 64 --requests-per-client 4 \\
        --max-tokens 64 --client-processes 4 [--api-server-count N] [--out FILE.json] \\
        [-- SERVE FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from pdserve.bench.report import revision_fields


@dataclass
class Trace:
    send: float
    recv: list[float] = field(default_factory=list)
    engine: list[float] = field(default_factory=list)
    engine_arrival: float | None = None
    server_arrival: float | None = None
    server_first_token: float | None = None


async def one_request(session, url: str, prompt: str, max_tokens: int) -> Trace:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_engine_timing": True}
    trace = Trace(send=time.monotonic())
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            now = time.monotonic()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("engine_time") is None:
                continue
            trace.recv.append(now)
            trace.engine.append(chunk["engine_time"])
            if "engine_arrival_time" in chunk:
                trace.engine_arrival = chunk["engine_arrival_time"]
                trace.server_arrival = chunk["server_arrival_time"]
                trace.server_first_token = chunk.get("server_first_token_time")
    return trace


async def client_loop(session, url: str, rounds: int, max_tokens: int, rng: random.Random
                      ) -> list[Trace]:
    traces = []
    for _ in range(rounds):
        prompt = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(32, 128)))
        traces.append(await one_request(session, url, prompt, max_tokens))
    return traces


@dataclass
class Load:
    traces: list[Trace]
    loop_lag_ms: list[float]
    """How late the client's own event loop woke a 1 ms timer: its share of every stamp."""


async def run_load(base: str, concurrency: int, rounds: int, max_tokens: int,
                   first_seed: int = 0) -> Load:
    import aiohttp

    url = base + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    lags: list[float] = []
    probe = asyncio.ensure_future(_probe_loop_lag(lags))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loops = [client_loop(session, url, rounds, max_tokens, random.Random(first_seed + i))
                 for i in range(concurrency)]
        results = await asyncio.gather(*loops)
    probe.cancel()
    return Load([t for traces in results for t in traces], lags)


async def _probe_loop_lag(lags: list[float], period_s: float = 0.001) -> None:
    # A busy client stamps sends late and chunks late; this says by how much, so that the
    # client's own delay is not mistaken for the server's.
    while True:
        start = time.monotonic()
        await asyncio.sleep(period_s)
        lags.append((time.monotonic() - start - period_s) * 1e3)


def _load_in_process(base: str, concurrency: int, rounds: int, max_tokens: int,
                     first_seed: int) -> Load:
    return asyncio.run(run_load(base, concurrency, rounds, max_tokens, first_seed))


def run_clients(base: str, args: argparse.Namespace) -> Load:
    """Spreads the clients over processes: one Python process parsing every chunk of 64
    streams would itself add milliseconds and be counted as server overhead."""
    shares = [args.concurrency // args.client_processes] * args.client_processes
    for i in range(args.concurrency % args.client_processes):
        shares[i] += 1
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(shares), mp_context=ctx) as pool:
        futures = [pool.submit(_load_in_process, base, share, args.requests_per_client,
                               args.max_tokens, sum(shares[:i]))
                   for i, share in enumerate(shares) if share]
        loads = [f.result() for f in futures]
    return Load([t for load in loads for t in load.traces],
                [lag for load in loads for lag in load.loop_lag_ms])


def overheads(traces: list[Trace]) -> dict[str, list[float]]:
    """Milliseconds, one list per measure."""
    out: dict[str, list[float]] = {k: [] for k in (
        "client_ttft", "engine_ttft", "ttft_overhead", "ttft_inbound", "inbound_http",
        "inbound_channel", "ttft_outbound", "outbound_channel", "outbound_http",
        "client_itl", "engine_itl", "itl_overhead", "delivery_delay")}
    for t in traces:
        if not t.recv or t.engine_arrival is None:
            continue
        ms = lambda x: x * 1e3
        out["client_ttft"].append(ms(t.recv[0] - t.send))
        out["engine_ttft"].append(ms(t.engine[0] - t.engine_arrival))
        out["ttft_overhead"].append(out["client_ttft"][-1] - out["engine_ttft"][-1])
        out["ttft_inbound"].append(ms(t.engine_arrival - t.send))
        if t.server_arrival is not None:
            out["inbound_http"].append(ms(t.server_arrival - t.send))
            out["inbound_channel"].append(ms(t.engine_arrival - t.server_arrival))
        out["ttft_outbound"].append(ms(t.recv[0] - t.engine[0]))
        if t.server_first_token is not None:
            out["outbound_channel"].append(ms(t.server_first_token - t.engine[0]))
            out["outbound_http"].append(ms(t.recv[0] - t.server_first_token))
        for i in range(1, len(t.recv)):
            client_gap, engine_gap = t.recv[i] - t.recv[i - 1], t.engine[i] - t.engine[i - 1]
            out["client_itl"].append(ms(client_gap))
            out["engine_itl"].append(ms(engine_gap))
            out["itl_overhead"].append(ms(client_gap - engine_gap))
        out["delivery_delay"] += [ms(r - e) for r, e in zip(t.recv, t.engine, strict=True)]
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {name: {"mean": statistics.fmean(v) if v else float("nan"),
                   "p50": percentile(v, 50), "p90": percentile(v, 90),
                   "p99": percentile(v, 99), "count": len(v)}
            for name, v in samples.items()}


def print_table(summary: dict[str, dict[str, float]]) -> None:
    print(f"{'measure (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>8}")
    for name, s in summary.items():
        print(f"{name:<16}{s['mean']:>10.2f}{s['p50']:>10.2f}{s['p90']:>10.2f}"
              f"{s['p99']:>10.2f}{s['count']:>8}")


# ---- server process -----------------------------------------------------------------------


def start_server(serve_flags: list[str], api_server_count: int = 1
                 ) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--api-server-count", str(api_server_count), *serve_flags]
    process = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return process, base
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("server did not start")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="Use a running server on this host instead of starting "
                        "one (it must share this host's clock).")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--out", help="Write the summary and the command here as JSON.")
    parser.add_argument("--label", default="", help="Free text saved with --out (the device).")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="HTTP processes of the server this starts (pdserve serve "
                        "--api-server-count); their CPU time is summed.")
    parser.add_argument("serve_flags", nargs="*", help="After --: flags for pdserve serve "
                        "(default: tiny).")
    args = parser.parse_args(argv)
    args.serve_flags = args.serve_flags or ["tiny"]
    if args.api_server_count < 1:
        parser.error(f"--api-server-count must be >= 1, not {args.api_server_count}")
    if any(flag.startswith("--api-server-count") for flag in args.serve_flags):
        parser.error("give --api-server-count before --, not among the serve flags: the "
                     "benchmark sums the CPU of that many HTTP processes")
    if args.url and args.api_server_count != 1:
        parser.error("--api-server-count is for the server this starts, not with --url")
    return args


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time of one process so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def http_pids(process: subprocess.Popen, base: str, count: int) -> list[int]:
    """The server's HTTP processes: the one started, and with ``count`` > 1 its other
    children except the engine (whose pid ``/v1/engine/info`` names) and multiprocessing's
    resource tracker."""
    if count == 1:
        return [process.pid]
    with urllib.request.urlopen(base + "/v1/engine/info", timeout=30) as resp:
        engine = json.load(resp)["engine_pid"]
    workers = [pid for pid in _children(process.pid)
               if pid != engine and b"resource_tracker" not in _cmdline(pid)]
    if len(workers) != count - 1:
        raise SystemExit(f"found {len(workers)} HTTP processes besides pid {process.pid}, not "
                         f"{count - 1}: their CPU could not be summed")
    return [process.pid, *workers]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def cpu_of(pids: list[int]) -> list[tuple[float, float]]:
    return [cpu_seconds(pid) for pid in pids]


def http_cpu_per_chunk(pids: list[int], cpu_start: list[tuple[float, float]] | None,
                       traces: list[Trace]) -> dict[str, float]:
    """The HTTP processes' CPU time per streamed chunk in the measured run (microseconds),
    summed over ``pids``: their cost per token, which on a loaded host decides how long a
    new request waits behind the chunk writes. Split into user and system (kernel) time: the
    kernel's part is mostly the socket write of each chunk, which no change to the server's
    Python removes. Empty when the server is not ours (``--url``)."""
    if not pids or cpu_start is None:
        return {}
    chunks = sum(len(t.recv) for t in traces)
    per_process = [(end[0] - start[0], end[1] - start[1])
                   for end, start in zip(cpu_of(pids), cpu_start, strict=True)]
    user = sum(u for u, _ in per_process)
    system = sum(s for _, s in per_process)
    return {"http_cpu_s": user + system, "http_user_s": user, "http_sys_s": system,
            "chunks": chunks, "http_cpu_us_per_chunk": (user + system) / chunks * 1e6,
            "http_user_us_per_chunk": user / chunks * 1e6,
            "http_sys_us_per_chunk": system / chunks * 1e6,
            "api_server_count": len(pids),
            "http_cpu_s_per_process": [u + s for u, s in per_process]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process, base = ((None, args.url) if args.url
                     else start_server(args.serve_flags, args.api_server_count))
    try:
        # One unmeasured round at full concurrency: kernel compilation, graph capture and
        # allocator growth happen on first use and are no part of the server's overhead.
        asyncio.run(run_load(base, args.concurrency, 1, args.max_tokens, first_seed=10**6))
        pids = http_pids(process, base, args.api_server_count) if process is not None else []
        cpu_start = cpu_of(pids) if pids else None
        load_before = os.getloadavg()
        start = time.monotonic()
        load = run_clients(base, args)
        wall = time.monotonic() - start
        host_load = {"before": load_before, "after": os.getloadavg()}
        http_cpu = http_cpu_per_chunk(pids, cpu_start, load.traces)
    finally:
        if process is not None:
            stop_server(process)
    traces = load.traces
    summary = summarize({**overheads(traces), "client_loop_lag": load.loop_lag_ms})
    print(f"{len(traces)} requests, {args.concurrency} concurrent, {wall:.1f} s; host load "
          f"average {host_load['before'][0]:.2f} before, {host_load['after'][0]:.2f} after")
    print_table(summary)
    if http_cpu:
        print(f"HTTP CPU ({http_cpu['api_server_count']} process(es)): "
              f"{http_cpu['http_cpu_us_per_chunk']:.1f} us per chunk "
              f"({http_cpu['http_cpu_s']:.2f} s for {http_cpu['chunks']} chunks; user "
              f"{http_cpu['http_user_us_per_chunk']:.1f}, system "
              f"{http_cpu['http_sys_us_per_chunk']:.1f} us per chunk)")
    if args.out:
        write_record(args, argv, wall, summary, traces, http_cpu, host_load)
    return 0


def write_record(args: argparse.Namespace, argv: list[str] | None, wall: float,
                 summary: dict[str, dict[str, float]], traces: list[Trace],
                 http_cpu: dict[str, float], host_load: dict[str, tuple[float, ...]]) -> None:
    command = ["python", "benchmarks/bench_server_overhead.py",
               *(sys.argv[1:] if argv is None else argv)]
    record = {"command": shlex.join(command), **revision_fields(),
              "label": args.label, "python": platform.python_version(), "wall_s": wall,
              "args": vars(args), "summary": summary, "http_process": http_cpu,
              "api_server_count": args.api_server_count if args.url is None else None,
              # 1/5/15-minute load averages: on a shared host, how much else was running.
              "host_load": host_load,
              # pdserve serve runs on uvloop when the Python that starts it can import it.
              "event_loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
              "first_trace": asdict(traces[0]) if traces else None}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
