"""A real standalone ZooKeeper for the registry tests, run from Debian's `zookeeper` package."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster.zk_local import (
    NOT_INSTALLED,
    QUORUM_MAIN,
    START_TIMEOUT_S,
    find_java,
    free_port,
    server_command,
    srvr,
    start_standalone,
    tail,
    write_config,
)
from pdserve.cluster.zk_local import (
    stop as stop_server,
)
from tests.server.conftest import Server, start_servers, stop_servers

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def late_bound_port() -> int:
    """A free port for a server that binds it only seconds later (a launcher's gateway, after
    its instances are up). Not from the kernel's ephemeral range, as ``free_port`` picks:
    meanwhile every outgoing connection on the host (Ray's, ZooKeeper's, the instances')
    takes ports from that range, and one took such a port once. Ray's workers listen on
    10002-19999, so the port comes from between those and the ephemeral range."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 32768
    candidates = range(20000, low)
    for port in random.sample(candidates, k=min(200, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """'127.0.0.1:PORT' of a standalone ZooKeeper that lives for the test session."""
    pytest.importorskip("kazoo", reason="kazoo not installed; pip install -e '.[cluster]'")
    java = find_java()
    if java is None:
        pytest.skip(NOT_INSTALLED)
    process, hosts = start_standalone(java, tmp_path_factory.mktemp("zookeeper"))
    try:
        yield hosts
    finally:
        stop_server(process)


GROUP_ROOT = "/pdtest"


def member_flags(zookeeper: str) -> tuple[str, ...]:
    """Flags of an instance that joins the 'chat' P/D group under ``GROUP_ROOT``."""
    return ("--kv-transfer-port", "0", "--registry", f"zk://{zookeeper}{GROUP_ROOT}",
            "--scenario", "chat")


@pytest.fixture(scope="session")
def zk_group(zookeeper: str) -> Iterator[tuple[Server, Server]]:
    """p0 (prefill) and d0 (decode), members of the 'chat' group in ``zookeeper`` for the
    session: the modules that read the group through gateways share them (each pair costs
    two server starts); a module may add members, and must have removed them when it ends."""
    flags = member_flags(zookeeper)
    servers = start_servers((*flags, "--role", "prefill", "--instance-id", "p0"),
                            (*flags, "--role", "decode", "--instance-id", "d0"))
    yield servers
    stop_servers(servers)


# ---- a three-server ensemble ----------------------------------------------------------------

class Ensemble:
    """Three ZooKeeper servers on loopback ports; each can be stopped and started again."""

    def __init__(self, java: str, workdir: Path) -> None:
        self.java, self.workdir = java, workdir
        self.client_ports = [free_port() for _ in range(3)]
        peers = [(free_port(), free_port()) for _ in range(3)]
        self.servers = [f"server.{i + 1}=127.0.0.1:{a}:{b}" for i, (a, b) in enumerate(peers)]
        self.processes: list[subprocess.Popen | None] = [None] * 3

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.client_ports)

    def start(self, index: int) -> None:
        server_dir = self.workdir / f"zk{index + 1}"
        (server_dir / "data").mkdir(parents=True, exist_ok=True)
        (server_dir / "data" / "myid").write_text(f"{index + 1}\n")
        config = write_config(server_dir, self.client_ports[index])
        with config.open("a") as out:
            out.write("initLimit=10\nsyncLimit=5\n" + "\n".join(self.servers) + "\n")
        with (server_dir / "server.log").open("ab") as log:
            self.processes[index] = subprocess.Popen(
                server_command(self.java, config, server_dir, QUORUM_MAIN),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, index: int) -> None:
        process = self.processes[index]
        if process is not None:
            stop_server(process)
            self.processes[index] = None

    def mode(self, index: int) -> str | None:
        """'leader', 'follower', or None while it serves no requests."""
        for line in srvr(self.client_ports[index]).decode(errors="replace").splitlines():
            if line.startswith("Mode: "):
                return line.removeprefix("Mode: ").strip()
        return None

    def wait_for_quorum(self, timeout_s: float = START_TIMEOUT_S * 2) -> None:
        deadline = time.monotonic() + timeout_s
        running = [i for i, p in enumerate(self.processes) if p is not None]
        while sorted(filter(None, map(self.mode, running))) != \
                sorted(["leader"] + ["follower"] * (len(running) - 1)):
            if time.monotonic() > deadline:
                logs = [tail(self.workdir / f"zk{i + 1}" / "server.log") for i in running]
                raise RuntimeError("no ZooKeeper quorum:\n" + "\n".join(logs))
            time.sleep(0.1)

    def leader(self) -> int:
        return next(i for i in range(3) if self.processes[i] and self.mode(i) == "leader")

    def close(self) -> None:
        for index in range(3):
            self.stop(index)


@pytest.fixture
def ensemble(tmp_path: Path) -> Iterator[Ensemble]:
    pytest.importorskip("kazoo", reason="kazoo not installed; pip install -e '.[cluster]'")
    java = find_java()
    if java is None:
        pytest.skip(NOT_INSTALLED)
    ensemble = Ensemble(java, tmp_path)
    try:
        for index in range(3):
            ensemble.start(index)
        ensemble.wait_for_quorum()
        yield ensemble
    finally:
        ensemble.close()
