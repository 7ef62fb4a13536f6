"""Measured: the real ZooKeeper registry (``pdserve/cluster/registry.py``) with thousands of
registered instances, against a real ZooKeeper server this script starts (Debian's
``zookeeper`` package, as the cluster tests do).

- Registration: ``--instances`` instances spread over ``--scenarios`` scenarios, registered
  by ``--registrars`` processes, each one ZooKeeper session (a real instance registers
  itself from its own process; thousands of sessions do not fit one small host).
- Gateway start: ``--watchers`` processes (each a gateway's registry client) fill their
  cache with every instance.
- Propagation: the time from one membership change (a probe instance registered, moved to
  the other role, unregistered) to every watcher's subscriber callback seeing it.
- ZooKeeper's memory: the JVM's resident set, before and after registration.

    python benchmarks/scale_registry.py --instances 10000 --scenarios 200 \\
        --out benchmarks/results/scale_registry_cpu.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.cluster.registry import Instance, ZooKeeperRegistry  # noqa: E402
from pdserve.cluster.zk_local import find_java, start_standalone  # noqa: E402
from pdserve.cluster.zk_local import stop as stop_server  # noqa: E402

PROBE_SCENARIO = "probe"


def instance(index: int, num_scenarios: int, role: str | None = None) -> Instance:
    port = 10_000 + index % 50_000
    return Instance(f"i{index:05d}", f"s{index % num_scenarios:03d}",
                    role or ("prefill" if index % 3 else "decode"),
                    f"10.0.{index // 250}.{index % 250}:{port}",
                    f"10.0.{index // 250}.{index % 250}:{port + 1}", "codellama-34b")


def start_zookeeper(workdir: Path) -> tuple[subprocess.Popen, str]:
    java = find_java()
    if java is None:
        raise SystemExit("needs java and Debian's zookeeper package")
    return start_standalone(java, workdir)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def registrar(hosts: str, indexes: list[int], num_scenarios: int, ready, stop) -> None:
    """One session registering its share of instances, then holding them until ``stop``."""
    registry = ZooKeeperRegistry(hosts, timeout_s=30.0)
    seconds = []
    for index in indexes:
        start = time.monotonic()
        registry.register(instance(index, num_scenarios))
        seconds.append(time.monotonic() - start)
    ready.put(seconds)
    stop.wait()
    registry.close()


def watcher(hosts: str, expected: int, reports, stop) -> None:
    """A gateway's registry client: cache fill time, then when each probe change shows."""
    start = time.monotonic()
    registry = ZooKeeperRegistry(hosts, timeout_s=60.0)
    while _count(registry) < expected:
        time.sleep(0.01)
    reports.put(("filled", time.monotonic() - start))
    seen: list[str | None] = [None]

    def on_change() -> None:
        probe = registry.instances(PROBE_SCENARIO, "prefill") or \
            registry.instances(PROBE_SCENARIO, "decode")
        state = probe[0].role if probe else "gone"
        if state != seen[0]:
            seen[0] = state
            reports.put((state, time.monotonic()))

    registry.subscribe(on_change)
    reports.put(("subscribed", time.monotonic()))
    stop.wait()
    registry.close()


def _count(registry: ZooKeeperRegistry) -> int:
    return sum(len(registry.instances(s, r)) for s in registry.scenarios()
               for r in ("prefill", "decode"))


def register_all(args, hosts: str, stop) -> tuple[list, dict]:
    ready = mp.Queue()
    shares = [list(range(i, args.instances, args.registrars)) for i in range(args.registrars)]
    processes = [mp.Process(target=registrar, args=(hosts, share, args.scenarios, ready, stop))
                 for share in shares]
    start = time.monotonic()
    for process in processes:
        process.start()
    seconds = [s for _ in processes for s in ready.get()]
    total = time.monotonic() - start
    return processes, {"instances": args.instances, "registrars": args.registrars,
                       "total_s": total, "per_s": args.instances / total,
                       "one_register_p50_ms": float(np.percentile(seconds, 50)) * 1e3,
                       "one_register_p99_ms": float(np.percentile(seconds, 99)) * 1e3}


def start_watchers(args, hosts: str, stop) -> tuple[list, list, dict]:
    queues = [mp.Queue() for _ in range(args.watchers)]
    processes = [mp.Process(target=watcher, args=(hosts, args.instances, q, stop))
                 for q in queues]
    for process in processes:
        process.start()
    fills = [q.get(timeout=600)[1] for q in queues]
    for q in queues:
        assert q.get(timeout=60)[0] == "subscribed"
    return processes, queues, {"watchers": args.watchers, "cache_fill_s": fills}


def probe_changes(args, hosts: str, queues) -> dict:
    """Each change made by a fresh client; the delay until every watcher saw it."""
    registry = ZooKeeperRegistry(hosts, timeout_s=30.0)
    delays: dict[str, list[float]] = {"register": [], "move": [], "unregister": []}
    for round_number in range(args.probes):
        probe = Instance(f"probe{round_number}", PROBE_SCENARIO, "prefill", "10.1.0.1:1",
                         "10.1.0.1:2")
        for change, expect, act in (
                ("register", "prefill", lambda p=probe: registry.register(p)),
                ("move", "decode", lambda p=probe: registry.register(
                    Instance(p.instance_id, p.scenario, "decode", p.http, p.kv))),
                ("unregister", "gone", lambda p=probe: registry.unregister(p.instance_id))):
            start = time.monotonic()
            act()
            seen = [_until(q, expect) for q in queues]
            delays[change].append(max(seen) - start)
    registry.close()
    return {change: {"p50_ms": float(np.percentile(d, 50)) * 1e3,
                     "p99_ms": float(np.percentile(d, 99)) * 1e3, "max_ms": max(d) * 1e3,
                     "samples": len(d)} for change, d in delays.items()}


def _until(queue, state: str) -> float:
    while True:
        seen, when = queue.get(timeout=60)
        if seen == state:
            return when


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--registrars", type=int, default=8)
    parser.add_argument("--watchers", type=int, default=4)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        zookeeper, hosts = start_zookeeper(Path(workdir))
        stop = mp.Event()
        try:
            result = measure(args, hosts, zookeeper.pid, stop)
        finally:
            stop.set()
            stop_server(zookeeper)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["zookeeper_command"] = "java -Xmx256m -XX:+UseSerialGC (standalone, one server)"
    report = {**result_header(config), "kind": "measured",
              "host": "2-core CPU host, shared", **result}
    print(report)
    if args.out:
        write_json(report, args.out)
    return 0


def measure(args, hosts: str, zookeeper_pid: int, stop) -> dict:
    rss_before = rss_mib(zookeeper_pid)
    registrars, registration = register_all(args, hosts, stop)
    rss_after = rss_mib(zookeeper_pid)
    watchers, queues, start = start_watchers(args, hosts, stop)
    propagation = probe_changes(args, hosts, queues)
    rss_watched = rss_mib(zookeeper_pid)
    stop.set()
    for process in registrars + watchers:
        process.join(timeout=30)
    return {"registration": registration, "gateway_start": start,
            "propagation_to_every_watcher": propagation,
            "zookeeper_rss_mib": {"empty": rss_before, "registered": rss_after,
                                  "with_watchers": rss_watched}}


if __name__ == "__main__":
    sys.exit(main())
