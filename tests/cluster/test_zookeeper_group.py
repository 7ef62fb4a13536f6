"""A P/D group that lives in a real ZooKeeper: instances join it themselves (`--role`), the
gateway finds them there, a role request moves one, and a stopped instance leaves it."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.registry import ZooKeeperRegistry
from tests.cluster.conftest import GROUP_ROOT, member_flags
from tests.cluster.group import wait_until
from tests.cluster.test_pd_e2e import BODY, GatewayThread
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow


def _ids(registry, role: str) -> list[str]:
    return [i.instance_id for i in registry.instances("chat", role)]


def test_group_in_zookeeper(zookeeper, zk_group):
    spare = start_server(*member_flags(zookeeper), "--role", "decode", "--instance-id", "d1")
    registry = ZooKeeperRegistry(zookeeper, GROUP_ROOT)
    gateway = GatewayThread(registry, default_scenario="chat")
    try:
        wait_until(timeout=20, predicate=lambda: _ids(registry, "prefill") == ["p0"]
              and _ids(registry, "decode") == ["d0", "d1"])
        status, _, raw = gateway.http.request("POST", "/v1/completions", BODY)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == BODY["max_tokens"]

        registry.request_role("d1", "prefill")  # what the ratio controller does
        wait_until(timeout=20, predicate=lambda: _ids(registry, "prefill") == ["d1", "p0"])
        assert _ids(registry, "decode") == ["d0"]

        assert spare.stop() == 0  # SIGTERM: it leaves the group before draining
        wait_until(timeout=20, predicate=lambda: _ids(registry, "prefill") == ["p0"])
        status, _, _ = gateway.http.request("POST", "/v1/completions", BODY)
        assert status == 200
    finally:
        gateway.stop()
        registry.close()
        spare.stop()
