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


def _is_serving(port: int) -> bool:
    # Not 'ruok': it answers "imok" about a second before sessions are accepted,
    # while 'srvr' says "not currently serving requests" until they are.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"srvr")
            return sock.makefile("rb").read().startswith(b"Zookeeper version")
    except OSError:
        return False


def _server_command(java: str, config: Path, workdir: Path) -> list[str]:
    # setpriv's parent-death signal: a pytest killed outright must not leave
    # a JVM behind holding the port.
    guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    jvm = ["-Xmx256m", "-XX:+UseSerialGC", f"-Dzookeeper.log.dir={workdir}"]
    jars = [ZOOKEEPER_JAR, *([LOG_BINDING_JAR] if LOG_BINDING_JAR.exists() else [])]
    classpath = ":".join(str(jar) for jar in jars)
    return [*guard, java, *jvm, "-cp", classpath, SERVER_MAIN, str(config)]


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
