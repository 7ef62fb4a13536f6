"""``pdserve serve --tensor-parallel-size 2`` on the CPU over real HTTP, as the decode instance
of a P/D group in a real ZooKeeper: the engine process (a daemon) starts its worker, reports
the group size, serves on its own and through the gateway; the registry records each
instance's group size; a killed worker stops the engine, which the server restarts (as for
any engine death) with a fresh worker, after which the instance and the pair serve again.

The prefill instance runs one rank of the dummy model and the decode instance two: dummy
weights are seeded per rank, so the two halves are different models and only token counts
are compared here (tests/parallel/test_tp_pd.py compares tokens on a checkpoint).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from pdserve.cluster.registry import ZooKeeperRegistry
from tests.cluster.conftest import zookeeper  # noqa: F401  (the fixture)
from tests.cluster.group import wait_until
from tests.cluster.test_pd_e2e import BODY, GatewayThread
from tests.server.conftest import Server, child_pids, engine_pid, start_servers
from tests.server.test_restart import _wait_for_new_engine

pytestmark = pytest.mark.slow
ROOT = "/tp-pd"


def _worker_pid(engine: int) -> int:
    for pid in child_pids(engine):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"pdserve.engine.tp_worker" in f.read():
                return pid
    raise AssertionError(f"engine {engine} has no tensor-parallel worker")


def _serves_alone(server: Server) -> None:
    done = server.openai().completions.create(model="tiny", prompt="hi", max_tokens=4,
                                              extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4


def _group_sizes(registry: ZooKeeperRegistry) -> dict[str, int]:
    return {i.instance_id: i.tensor_parallel_size
            for role in ("prefill", "decode") for i in registry.instances("chat", role)}


def _exited(pid: int) -> bool:
    """Dead, reaped or not (its parent, the engine, reaps it only when it next looks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _complete(gateway: GatewayThread) -> tuple[int, dict]:
    status, _, raw = gateway.http.request("POST", "/v1/completions", BODY)
    return status, json.loads(raw)


def _served(gateway: GatewayThread) -> bool:
    status, body = _complete(gateway)
    assert status in (200, 503), body
    if status == 200:
        assert body["usage"]["completion_tokens"] == BODY["max_tokens"]
    return status == 200


def test_group_with_a_tp2_decode_instance_and_its_worker_killed(zookeeper):  # noqa: F811
    flags = ("--kv-transfer-port", "0", "--registry", f"zk://{zookeeper}{ROOT}",
             "--scenario", "chat")
    prefill, decode = start_servers(
        (*flags, "--role", "prefill", "--instance-id", "p0"),
        (*flags, "--role", "decode", "--instance-id", "d0", "--tensor-parallel-size", "2",
         "--engine-restarts", "2", "--engine-restart-backoff-s", "0.2"))
    registry = ZooKeeperRegistry(zookeeper, ROOT)
    gateway = GatewayThread(registry, default_scenario="chat")
    try:
        wait_until(timeout=20, predicate=lambda: _group_sizes(registry) == {"p0": 1, "d0": 2})
        _, _, raw = gateway.http.request("GET", "/cluster/groups")
        listed = json.loads(raw)["groups"]["chat"]
        assert [i["tensor_parallel_size"] for i in listed["decode"]] == [2]
        status, _, raw = decode.request("GET", "/v1/engine/info")
        assert status == 200 and json.loads(raw)["tensor_parallel_size"] == 2
        _serves_alone(decode)
        status, body = _complete(gateway)
        assert status == 200 and body["usage"]["completion_tokens"] == BODY["max_tokens"]

        engine = engine_pid(decode)
        worker = _worker_pid(engine)
        os.kill(worker, signal.SIGKILL)
        wait_until(timeout=20, predicate=lambda: _exited(worker))
        # The request that finds the worker gone fails retryably: its decode instance's
        # engine stops, and the gateway answers 503 with no other decode instance listed.
        status, body = _complete(gateway)
        assert status == 503 and "no decode instance" in body["error"]["message"], body
        _wait_for_new_engine(decode, engine)
        assert "tensor-parallel rank 1" in decode.log_text(), decode.log_text()
        _worker_pid(engine_pid(decode))  # the new engine has its own worker
        _serves_alone(decode)
        # The gateway routes to the instance again once its failure ages out (5 s).
        wait_until(timeout=60, poll_s=0.5, predicate=lambda: _served(gateway))
        assert decode.stop() == 0
    finally:
        gateway.stop()
        registry.close()
        for server in (prefill, decode):
            server.stop()
