"""A P/D group whose registry is a three-server ZooKeeper ensemble: serving goes on while one
server stops, then the leader (no quorum left: ZooKeeper answers nothing, and the gateway
routes with the membership it last saw), and after both come back (instances whose session
expired meanwhile register again; a new member is seen)."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.cluster.registry import Instance, ZooKeeperRegistry
from tests.cluster.group import SECRET, wait_until
from tests.cluster.test_pd_e2e import BODY, GatewayThread
from tests.server.conftest import start_servers, stop_servers

pytestmark = pytest.mark.slow


def _members(registry) -> dict[str, list[str]]:
    return {role: [i.instance_id for i in registry.instances("chat", role)]
            for role in ("prefill", "decode")}


def _wait_stable(registry, members: dict, hold_s: float, timeout: float) -> None:
    deadline, since = time.monotonic() + timeout, None
    while True:
        now = time.monotonic()
        assert now < deadline, f"membership never held {hold_s} s: {_members(registry)}"
        if _members(registry) != members:
            since = None
        elif since is None:
            since = now
        elif now - since >= hold_s:
            return
        time.sleep(0.05)


def test_serving_goes_on_through_a_server_and_then_the_leader_stopping(ensemble):
    url = f"zk://{ensemble.hosts}/pdtest"
    flags = ("--kv-transfer-port", "0", "--registry", url, "--scenario", "chat",
             "--cluster-secret", SECRET)
    servers = start_servers((*flags, "--role", "prefill", "--instance-id", "p0"),
                            (*flags, "--role", "decode", "--instance-id", "d0"))
    registry = ZooKeeperRegistry(ensemble.hosts, "/pdtest")
    gateway = GatewayThread(registry, default_scenario="chat", cluster_secret=SECRET)
    statuses: dict[str, list[int]] = {}

    def ask(phase: str, count: int = 3) -> None:
        for _ in range(count):
            status, _, raw = gateway.http.request("POST", "/v1/completions", BODY)
            statuses.setdefault(phase, []).append(status)
            assert status == 200, raw
            assert json.loads(raw)["usage"]["completion_tokens"] == BODY["max_tokens"]

    everyone = {"prefill": ["p0"], "decode": ["d0"]}
    try:
        wait_until(timeout=90, predicate=lambda: _members(registry) == everyone)
        ask("all three servers")
        leader = ensemble.leader()
        follower = next(i for i in range(3) if i != leader)
        ensemble.stop(follower)
        ask("a follower stopped")
        ensemble.stop(ensemble.leader())  # one of three left: no quorum
        assert ensemble.mode(3 - leader - follower) is None  # it serves nobody now
        ask("the leader stopped too (no quorum)")
        assert _members(registry) == everyone  # the last membership is kept
        ensemble.start(follower)
        ensemble.start(leader)
        ensemble.wait_for_quorum()
        # Back with quorum, ZooKeeper first expires the sessions that lapsed (their nodes go)
        # and the instances then register again: the old nodes can still be listed for a
        # moment, so wait for the membership to hold a while, not merely to be seen once.
        _wait_stable(registry, everyone, hold_s=5.0, timeout=120)
        ask("both back")
        newcomer = ZooKeeperRegistry(ensemble.hosts, "/pdtest")  # ZooKeeper takes writes
        newcomer.register(Instance("p1", "chat", "prefill", "127.0.0.1:1", "127.0.0.1:1",
                                   "tiny"))
        wait_until(timeout=90, predicate=lambda: _members(registry)["prefill"] == ["p0", "p1"])
        newcomer.close()
    finally:
        print({phase: f"{s.count(200)}/{len(s)} answered" for phase, s in statuses.items()})
        gateway.stop()
        registry.close()
        stop_servers(servers)
