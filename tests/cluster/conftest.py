"""A real standalone ZooKeeper for the registry tests, run from Debian's `zookeeper` package."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The jar's manifest Class-Path names its dependencies in /usr/share/java, so
# this one jar is the package's server classpath (zkEnv.sh adds only its conf
# directory, for a log4j file that no binding on that path reads).
ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
# The package depends on libslf4j-java; without a binding the server log is
# empty, and a failed start would say nothing.
LOG_BINDING_JAR = Path("/usr/share/java/slf4j-simple.jar")
SERVER_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"
START_TIMEOUT_S = 30.0
NOT_INSTALLED = "Debian package zookeeper not installed; .ci/run installs it"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_config(workdir: Path, port: int) -> Path:
    config = workdir / "zoo.cfg"
    lines = [
        "tickTime=2000",
        f"dataDir={workdir / 'data'}",
        f"clientPort={port}",
        "clientPortAddress=127.0.0.1",
        "admin.enableServer=false",  # its Jetty would claim port 8080
        "4lw.commands.whitelist=srvr",
    ]
    config.write_text("\n".join(lines) + "\n")
    return config


def _srvr(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"srvr")
            return sock.makefile("rb").read()
    except OSError:
        return b""


def _is_serving(port: int) -> bool:
    # Not 'ruok': it answers "imok" about a second before sessions are accepted,
    # while 'srvr' says "not currently serving requests" until they are.
    return _srvr(port).startswith(b"Zookeeper version")


def _server_command(java: str, config: Path, workdir: Path,
                    main: str = SERVER_MAIN) -> list[str]:
    # setpriv's parent-death signal: a pytest killed outright must not leave
    # a JVM behind holding the port.
    guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    jvm = ["-Xmx256m", "-XX:+UseSerialGC", f"-Dzookeeper.log.dir={workdir}"]
    jars = [ZOOKEEPER_JAR, *([LOG_BINDING_JAR] if LOG_BINDING_JAR.exists() else [])]
    classpath = ":".join(str(jar) for jar in jars)
    return [*guard, java, *jvm, "-cp", classpath, main, str(config)]


def _wait_until_serving(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _is_serving(port):
        if process.poll() is not None:
            raise RuntimeError(f"ZooKeeper exited with {process.returncode}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ZooKeeper not serving after {START_TIMEOUT_S} s:\n{_tail(log)}")
        time.sleep(0.05)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def zookeeper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """'127.0.0.1:PORT' of a standalone ZooKeeper that lives for the test session."""
    pytest.importorskip("kazoo", reason="kazoo not installed; pip install -e '.[cluster]'")
    java = shutil.which("java")
    if java is None or not ZOOKEEPER_JAR.exists():
        pytest.skip(NOT_INSTALLED)
    workdir = tmp_path_factory.mktemp("zookeeper")
    port = _free_port()
    config = _write_config(workdir, port)
    log = workdir / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            _server_command(java, config, workdir),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_serving(process, port, log)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(process)


# ---- a three-server ensemble ----------------------------------------------------------------

QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"


class Ensemble:
    """Three ZooKeeper servers on loopback ports; each can be stopped and started again."""

    def __init__(self, java: str, workdir: Path) -> None:
        self.java, self.workdir = java, workdir
        self.client_ports = [_free_port() for _ in range(3)]
        peers = [(_free_port(), _free_port()) for _ in range(3)]
        self.servers = [f"server.{i + 1}=127.0.0.1:{a}:{b}" for i, (a, b) in enumerate(peers)]
        self.processes: list[subprocess.Popen | None] = [None] * 3

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.client_ports)

    def start(self, index: int) -> None:
        server_dir = self.workdir / f"zk{index + 1}"
        (server_dir / "data").mkdir(parents=True, exist_ok=True)
        (server_dir / "data" / "myid").write_text(f"{index + 1}\n")
        config = _write_config(server_dir, self.client_ports[index])
        with config.open("a") as out:
            out.write("initLimit=10\nsyncLimit=5\n" + "\n".join(self.servers) + "\n")
        with (server_dir / "server.log").open("ab") as log:
            self.processes[index] = subprocess.Popen(
                _server_command(self.java, config, server_dir, QUORUM_MAIN),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, index: int) -> None:
        process = self.processes[index]
        if process is not None:
            _stop(process)
            self.processes[index] = None

    def mode(self, index: int) -> str | None:
        """'leader', 'follower', or None while it serves no requests."""
        for line in _srvr(self.client_ports[index]).decode(errors="replace").splitlines():
            if line.startswith("Mode: "):
                return line.removeprefix("Mode: ").strip()
        return None

    def wait_for_quorum(self, timeout_s: float = START_TIMEOUT_S * 2) -> None:
        deadline = time.monotonic() + timeout_s
        running = [i for i, p in enumerate(self.processes) if p is not None]
        while sorted(filter(None, map(self.mode, running))) != \
                sorted(["leader"] + ["follower"] * (len(running) - 1)):
            if time.monotonic() > deadline:
                logs = [_tail(self.workdir / f"zk{i + 1}" / "server.log") for i in running]
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
    java = shutil.which("java")
    if java is None or not ZOOKEEPER_JAR.exists():
        pytest.skip(NOT_INSTALLED)
    ensemble = Ensemble(java, tmp_path)
    try:
        for index in range(3):
            ensemble.start(index)
        ensemble.wait_for_quorum()
        yield ensemble
    finally:
        ensemble.close()
