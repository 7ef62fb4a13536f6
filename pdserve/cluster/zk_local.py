"""A local ZooKeeper from Debian's ``zookeeper`` package: one standalone server or the
members of an ensemble, started as plain JVM processes. The cluster tests and
``benchmarks/scale_registry.py`` start theirs here."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from pdserve.testing import free_port

# The jar's manifest Class-Path names its dependencies in /usr/share/java, so
# this one jar is the package's server classpath (zkEnv.sh adds only its conf
# directory, for a log4j file that no binding on that path reads).
ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
# The package depends on libslf4j-java; without a binding the server log is
# empty, and a failed start would say nothing.
LOG_BINDING_JAR = Path("/usr/share/java/slf4j-simple.jar")
SERVER_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"
QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
START_TIMEOUT_S = 30.0
NOT_INSTALLED = "Debian package zookeeper not installed; .ci/run installs it"


def find_java() -> str | None:
    """The java binary, or None when it or the zookeeper package is missing."""
    java = shutil.which("java")
    return java if java is not None and ZOOKEEPER_JAR.exists() else None


def write_config(workdir: Path, port: int) -> Path:
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


def srvr(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"srvr")
            return sock.makefile("rb").read()
    except OSError:
        return b""


def is_serving(port: int) -> bool:
    # Not 'ruok': it answers "imok" about a second before sessions are accepted,
    # while 'srvr' says "not currently serving requests" until they are.
    return srvr(port).startswith(b"Zookeeper version")


def server_command(java: str, config: Path, workdir: Path,
                   main: str = SERVER_MAIN) -> list[str]:
    # setpriv's parent-death signal: a parent killed outright must not leave
    # a JVM behind holding the port.
    guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    jvm = ["-Xmx256m", "-XX:+UseSerialGC", f"-Dzookeeper.log.dir={workdir}"]
    jars = [ZOOKEEPER_JAR, *([LOG_BINDING_JAR] if LOG_BINDING_JAR.exists() else [])]
    classpath = ":".join(str(jar) for jar in jars)
    return [*guard, java, *jvm, "-cp", classpath, main, str(config)]


def wait_until_serving(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not is_serving(port):
        if process.poll() is not None:
            raise RuntimeError(f"ZooKeeper exited with {process.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ZooKeeper not serving after {START_TIMEOUT_S} s:\n{tail(log)}")
        time.sleep(0.05)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_standalone(java: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """One server on a free loopback port, serving when this returns: (process, hosts)."""
    port = free_port()
    config = write_config(workdir, port)
    log = workdir / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(server_command(java, config, workdir),
                                   stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        wait_until_serving(process, port, log)
    except BaseException:
        stop(process)
        raise
    return process, f"127.0.0.1:{port}"
