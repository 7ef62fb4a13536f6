"""A P/D group of real `pdserve serve` processes (tiny model, CPU) behind a gateway, for the
reliability tests: start, freeze, kill and replace instances, and stream through the
gateway as a client would."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

import aiohttp

from pdserve.cluster.registry import Instance, MemoryRegistry
from tests.cluster.test_pd_e2e import GatewayThread
from tests.server.conftest import Server, start_server, start_servers, stop_servers

SECRET = "group-test-secret"
SCENARIO = "default"
# A lost KV transfer fails its request after this long (the instances' flag): short, so
# that a test of it is quick; far above what a transfer of the tiny model's KV takes.
KV_TIMEOUT_S = 5


def wait_until(predicate, timeout: float = 60.0, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(poll_s)


MEMBER_FLAGS = ("--kv-transfer-port", "0", "--kv-transfer-timeout", str(KV_TIMEOUT_S),
                "--cluster-secret", SECRET)


def start_member() -> Server:
    return start_server(*MEMBER_FLAGS)


def pd_info(server: Server) -> dict:
    status, _, raw = server.request("GET", "/pd/info", headers={"X-PDServe-Cluster-Secret":
                                                                SECRET})
    assert status == 200, raw
    return json.loads(raw)


def listing(server: Server, role: str, name: str, kv: str | None = None) -> Instance:
    info = pd_info(server)
    address = f"127.0.0.1:{server.port}"
    return Instance(name, SCENARIO, role, address, kv or info["kv_address"], info["model"])


def kill(server: Server) -> None:
    """SIGKILL, as a crash: the server process and its engine process, nothing cleaned up."""
    for pid in [*server.engine_pids(), server.process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.process.wait()


def freeze(server: Server) -> None:
    """SIGSTOP: it keeps its sockets (connections are accepted) but answers nothing."""
    for pid in [server.process.pid, *server.engine_pids()]:
        os.kill(pid, signal.SIGSTOP)


def thaw(server: Server) -> None:
    for pid in [server.process.pid, *server.engine_pids()]:
        os.kill(pid, signal.SIGCONT)


@dataclass
class Group:
    """Named members listed in a memory registry the gateway reads."""

    members: dict[str, Server] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    registry: MemoryRegistry = field(default_factory=MemoryRegistry)
    gateway: GatewayThread | None = None

    def add(self, name: str, role: str, server: Server | None = None) -> Server:
        """Starts (or takes) a member and lists it. It is in ``members`` from the start, so
        ``close`` stops it even if it never joins, and in ``roles`` only once registered:
        a chaos thread picks its victims from ``roles``, and one killed while still being
        asked for its listing made its own replacement fail."""
        server = server or start_member()
        self.members[name] = server
        self.registry.register(listing(server, role, name))
        self.roles[name] = role
        return server

    def remove(self, name: str) -> None:
        """Leaves the registry, as its ZooKeeper node would when its session expires."""
        self.registry.unregister(name)
        self.members.pop(name, None)
        self.roles.pop(name, None)

    def open_gateway(self, **options) -> GatewayThread:
        self.gateway = GatewayThread(self.registry, cluster_secret=SECRET, **options)
        return self.gateway

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        stop_servers(list(self.members.values()))  # replacements may still be joining
        self.registry.close()

    def retries(self, stage: str) -> float:
        key = f'pdserve_gateway_retries_total{{scenario="{SCENARIO}",stage="{stage}"}}'
        return self.gateway.http.metrics().get(key, 0.0)


def start_group(**gateway_options) -> Group:
    """p0 and p1 (prefill), d0 and d1 (decode), started side by side, and a gateway."""
    group = Group()
    # start_servers: ports drawn while all are held (two drawn at once could be one), and
    # the others stopped if one fails to start (they would outlive the test run)
    servers = start_servers(*[MEMBER_FLAGS] * 4)
    for name, role, server in zip(("p0", "p1", "d0", "d1"), ("prefill",) * 2 + ("decode",) * 2,
                                  servers, strict=True):
        group.add(name, role, server)
    group.open_gateway(**gateway_options)
    return group


@dataclass
class Streamed:
    """What a streaming client got: the text, the chunk ids, the usage, any error."""

    status: int
    text: str = ""
    ids: set[str] = field(default_factory=set)
    roles: int = 0
    usage: dict | None = None
    error: str | None = None
    done: bool = False
    chunks: int = 0


async def stream(session: aiohttp.ClientSession, url: str, body: dict,
                 after_chunks: int = 0, on_chunks=None) -> Streamed:
    """Streams one request (completions or chat, by its body); ``on_chunks`` runs once,
    after ``after_chunks`` chunks have arrived (to break something mid-answer)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(url + path, json={**body, "stream": True}) as resp:
        got = Streamed(resp.status)
        if resp.status != 200:
            got.error = (await resp.text())[:500]
            return got
        async for line in resp.content:
            _take(got, line)
            if on_chunks is not None and got.chunks == after_chunks:
                await asyncio.get_running_loop().run_in_executor(None, on_chunks)
    return got


def _take(got: Streamed, line: bytes) -> None:
    payload = line.removeprefix(b"data:").strip()
    if not line.startswith(b"data:") or not payload:
        return
    if payload == b"[DONE]":
        got.done = True
        return
    chunk = json.loads(payload)
    if "error" in chunk:
        got.error = chunk["error"]["message"]
        return
    assert "pdserve_token_ids" not in chunk  # internal: the gateway strips it
    got.chunks += 1
    got.ids.add(chunk["id"])
    got.usage = chunk.get("usage") or got.usage
    for choice in chunk["choices"]:
        delta = choice.get("delta")
        got.text += choice["text"] if delta is None else delta.get("content") or ""
        got.roles += 1 if delta and "role" in delta else 0
