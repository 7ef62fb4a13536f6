"""A real ``pdserve serve`` process on a free loopback port, started and waited for: what
benchmarks that drive real instances (``benchmarks/validate_sim.py``) start theirs with."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

START_TIMEOUT_S = 600.0  # a large model on a GPU loads for minutes
# A /health request costs a fraction of a millisecond: polling often sees a start at once.
HEALTH_POLL_S = 0.05


_GIVEN_PORTS: set[int] = set()
_GIVEN_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process: servers
    started from several threads at once (replacements joining a group) could otherwise be
    handed the same port, one failing to bind while its health check reaches the other."""
    with _GIVEN_LOCK:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _GIVEN_PORTS:
                _GIVEN_PORTS.add(port)
                return port


@dataclass
class ServeProcess:
    process: subprocess.Popen
    port: int
    log: IO[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 60.0) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_serve(model: str, *flags: str, timeout_s: float = START_TIMEOUT_S,
                log_path: Path | None = None, env: dict[str, str] | None = None
                ) -> ServeProcess:
    """``pdserve serve MODEL FLAGS`` on 127.0.0.1, returned once ``/health`` answers 200;
    its output goes to ``log_path`` (kept) or a temporary file; ``env``: its whole
    environment (default: this process's)."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "serve", model, "--host", "127.0.0.1",
               "--port", str(port), *flags]
    log = open(log_path, "w+b") if log_path is not None else tempfile.TemporaryFile()
    server = ServeProcess(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env),
                          port, log)
    try:
        _wait_healthy(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_healthy(server: ServeProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError("pdserve serve exited:\n" + server.log_text())
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"pdserve serve not healthy after {timeout_s:.0f} s:\n"
                       + server.log_text())
