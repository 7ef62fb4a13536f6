"""A real ``pdserve serve`` process on the tiny model, reached over a real socket."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from pdserve.testing import HEALTH_POLL_S, free_port

START_TIMEOUT_S = 120
BIND_ATTEMPTS = 3  # starts on fresh ports when another process took the drawn one


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    api_key: str | None = None
    log: Any = None
    client_tls: Any = None
    """An ``ssl.SSLContext`` trusting the server's certificate: it serves HTTPS."""

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    @property
    def url(self) -> str:
        return f"{'https' if self.client_tls else 'http'}://127.0.0.1:{self.port}"

    def openai(self, **kwargs):
        import openai

        if self.client_tls is not None:
            kwargs.setdefault("http_client", openai.DefaultHttpxClient(verify=self.client_tls))
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                                  max_retries=0, **kwargs)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        """Raw HTTP: (status, headers, body), errors included."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if self.api_key and "Authorization" not in all_headers:
            all_headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=all_headers)
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.client_tls) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def metrics(self) -> dict[str, float]:
        _, _, body = self.request("GET", "/metrics")
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def engine_pids(self) -> list[int]:
        return child_pids(self.process.pid)

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def engine_pid(server: Server, missing_ok: bool = False) -> int | None:
    """The server's engine process (a ``multiprocessing`` spawn child)."""
    for pid in server.engine_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    if missing_ok:
        return None
    raise AssertionError("no engine process")


def start_server(*flags: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 client_key: str | None = None, port: int | None = None,
                 client_tls: Any = None) -> Server:
    """``api_key`` goes on the command line; ``env`` adds environment variables;
    ``client_key`` is the key the test clients send (``api_key`` by default). A port drawn
    here can be taken by another process before the server binds it (an outgoing
    connection's ephemeral port, another server's ``--kv-transfer-port 0``): the server
    then exits naming the port, and is started again on a fresh one. ``client_tls``: the
    test clients' TLS context, for a server started with ``--ssl-*`` flags."""
    if port is not None:
        return _start_server_on(port, flags, api_key, env, client_key, client_tls)
    for _ in range(BIND_ATTEMPTS - 1):
        try:
            return _start_server_on(free_port(), flags, api_key, env, client_key, client_tls)
        except RuntimeError as exc:
            if "Address already in use" not in str(exc):
                raise
    return _start_server_on(free_port(), flags, api_key, env, client_key, client_tls)


def _start_server_on(port: int, flags: tuple[str, ...], api_key: str | None,
                     env: dict[str, str] | None, client_key: str | None,
                     client_tls: Any = None) -> Server:
    cmd = [sys.executable, "-m", "pdserve", "serve", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--device", "cpu", *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    # A file, not a pipe: a pipe nobody reads would block a chatty server.
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})
    server = Server(process, port, client_key or api_key, log, client_tls)
    wait_healthy(server)
    return server


def start_servers(*flag_sets: tuple[str, ...]) -> list[Server]:
    """One server per flag set, started side by side (most of a start is loading torch and
    the model, which the cores do at once), on ports that differ: all of them are held at
    the same time while they are drawn. Stops the others when one fails to start."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in flag_sets]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in sockets]
    with ThreadPoolExecutor(len(flag_sets)) as pool:
        futures = [pool.submit(start_server, *flags, port=port)
                   for flags, port in zip(flag_sets, ports, strict=True)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        stop_servers(started)
        raise failed[0]
    return started


def stop_servers(servers) -> None:
    """Stops them side by side: each drains and exits on its own."""
    servers = list(servers)
    if servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(Server.stop, servers))


def wait_engine_idle(server, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["pdserve_num_requests_running"] == 0 and m["pdserve_num_requests_waiting"] == 0 \
                and m["pdserve_kv_cache_usage_ratio"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"engine still busy: {m}")


def wait_healthy(server: Server, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError("server exited:\n" + server.log_text())
        try:
            if server.request("GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(HEALTH_POLL_S)
    server.stop()
    # the log's end says where the start stalled (what a flaky start needs to be fixed)
    raise RuntimeError(f"server on port {server.port} did not become healthy in {timeout:.0f} "
                       f"s; the end of its log:\n{server.log_text()[-3000:]}")


@pytest.fixture(scope="session")
def default_server():
    srv = start_server("--num-blocks", "512", "--max-num-seqs", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(default_server):
    """One server for every module that takes the default flags (each start and stop costs
    seconds of two processes loading torch), idle when a module begins, as a fresh one would
    be: no request of an earlier module still running, waiting or holding pages. What a
    module measures on it is a difference (metrics before and after), never a total."""
    wait_engine_idle(default_server)
    return default_server


@pytest.fixture(scope="module")
def launch():
    """Starts extra servers for a module (flags as on the command line); stops them after."""
    started: list[Server] = []

    def start(*flags: str, **options) -> Server:
        started.append(start_server(*flags, **options))
        return started[-1]

    yield start
    stop_servers(started)


def write_tls_files(folder) -> Any:
    """A test CA's server certificate for 127.0.0.1 (``key.pem``, ``cert.pem``), the CA
    (``ca.pem``) and a client certificate with its key (``client.pem``) in ``folder``;
    returns the CA (``trustme``, a test dependency)."""
    import trustme

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    server_cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    server_cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    client_cert = ca.issue_cert("client@example.com")
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(folder / "client.pem"))
    return ca


def trusting(ca, client_pem=None) -> Any:
    """A client TLS context trusting ``ca`` (and sending ``client_pem``'s certificate)."""
    import ssl

    context = ssl.create_default_context()
    ca.configure_trust(context)
    if client_pem is not None:
        context.load_cert_chain(str(client_pem))
    return context

