"""Measured: one gateway process's routing capacity, and several side by side, with real
HTTP against stand-in instances that answer at once (``pdserve/sim/standin.py``).

Every request goes client -> gateway -> stand-in ``/pd/prefill`` -> stand-in ``/pd/decode``
-> client, through the real gateway (``pdserve/cluster/gateway.py``, on-demand dispatch,
a group of ``--group-size`` prefill and as many decode instances). Rows: closed-loop
clients at each ``--concurrency``, for each number of gateway processes, plus the same
clients straight to a stand-in's ``/pd/decode`` (one hop, no gateway): the gateway's added
latency is the difference. Clients, gateways and stand-ins share this host's cores, so the
core count caps what several gateways can add (the report records it).

    python benchmarks/scale_gateway.py --out benchmarks/results/scale_gateway_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import result_header, write_json  # noqa: E402

REQUEST = {"model": "standin", "prompt": "hello", "max_tokens": 1}
DECODE_OFFER = {"kind": "completions", "request": REQUEST, "transfer_id": "t",
                "first_token": 1}


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def serve_standins(ports: list[int]) -> None:
    from aiohttp import web

    from pdserve.sim.standin import build_standin_app

    async def main() -> None:
        for port in ports:
            runner = web.AppRunner(build_standin_app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_gateway(port: int, standin_ports: list[int], group_size: int) -> None:
    from pdserve.cluster.app import start_gateway
    from pdserve.cluster.config import GatewayConfig
    from pdserve.cluster.registry import Instance, MemoryRegistry

    registry = MemoryRegistry()
    for i in range(2 * group_size):
        address = f"127.0.0.1:{standin_ports[i % len(standin_ports)]}"
        role = "prefill" if i < group_size else "decode"
        registry.register(Instance(f"n{i:04d}", "default", role, address, address))
    config = GatewayConfig(host="127.0.0.1", port=port)

    async def main() -> None:
        await start_gateway(config, registry)
        await asyncio.Event().wait()

    asyncio.run(main())


def load(urls: list[str], body: dict, concurrency: int, duration_s: float, results) -> None:
    """A client process: ``concurrency`` requests always in flight, for ``duration_s``."""
    import aiohttp

    async def worker(session, url: str, end: float, latencies: list, errors: list) -> None:
        while time.monotonic() < end:
            start = time.monotonic()
            async with session.post(url, json=body) as resp:
                await resp.read()
                (latencies if resp.status == 200 else errors).append(time.monotonic() - start)

    async def main() -> tuple[list, int]:
        latencies, errors = [], []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            end = time.monotonic() + duration_s
            await asyncio.gather(*(worker(session, urls[i % len(urls)], end, latencies, errors)
                                   for i in range(concurrency)))
        return latencies, len(errors)

    results.put(asyncio.run(main()))


def measure(urls: list[str], body: dict, concurrency: int, args) -> dict:
    results = mp.Queue()
    per_client = max(1, concurrency // args.clients)
    clients = [mp.Process(target=load, args=(urls, body, per_client, args.duration_s, results))
               for _ in range(args.clients)]
    for client in clients:
        client.start()
    latencies, errors = [], 0
    for _ in clients:
        got, failed = results.get(timeout=args.duration_s + 120)
        latencies += got
        errors += failed
    for client in clients:
        client.join()
    ms = np.array(latencies) * 1e3
    return {"concurrency": per_client * args.clients, "requests": len(latencies),
            "errors": errors, "requests_per_s": len(latencies) / args.duration_s,
            "latency_p50_ms": float(np.percentile(ms, 50)),
            "latency_p99_ms": float(np.percentile(ms, 99))}


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def run_rows(args) -> list[dict]:
    standin_ports = free_ports(args.standins)
    processes = [mp.Process(target=serve_standins, args=(standin_ports,), daemon=True)]
    gateway_ports = free_ports(max(args.gateways))
    processes += [mp.Process(target=serve_gateway, args=(p, standin_ports, args.group_size),
                             daemon=True) for p in gateway_ports]
    for process in processes:
        process.start()
    for port in gateway_ports:
        wait_ready(f"http://127.0.0.1:{port}/health")
    rows = []
    direct = [f"http://127.0.0.1:{p}/pd/decode" for p in standin_ports]
    for concurrency in args.concurrency:
        rows.append({"path": "direct to a stand-in's /pd/decode",
                     **measure(direct, DECODE_OFFER, concurrency, args)})
        for gateways in args.gateways:
            urls = [f"http://127.0.0.1:{p}/v1/completions" for p in gateway_ports[:gateways]]
            rows.append({"path": "through the gateway", "gateways": gateways,
                         **measure(urls, REQUEST, concurrency, args)})
            print(rows[-1], flush=True)
    for process in processes:
        process.terminate()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateways", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2], help="Gateway process counts to measure.")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 16, 64], help="Requests in flight, over all clients.")
    parser.add_argument("--group-size", type=int, default=50,
                        help="Prefill instances (and as many decode) the gateway routes over.")
    parser.add_argument("--standins", type=int, default=2, help="Stand-in server ports.")
    parser.add_argument("--clients", type=int, default=2, help="Client processes.")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = run_rows(args)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    result = {**result_header(config), "kind": "measured", "cpu_cores": os.cpu_count(),
              "host": "CPU host shared with other work; clients, gateways and stand-ins "
                      "on the same cores", "rows": rows}
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
