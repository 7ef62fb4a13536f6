"""The cluster registry, against a real ZooKeeper and the in-process store alike."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from pdserve.cluster.registry import (
    Instance,
    MemoryRegistry,
    MemoryStore,
    Registry,
    ZooKeeperRegistry,
    make_registry,
)

Connect = Callable[[], Registry]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Poll: other clients see a change one ZooKeeper watch round trip later."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def make_instance(instance_id: str, scenario: str = "chat", role: str = "prefill") -> Instance:
    port = 8000 + len(instance_id)
    return Instance(instance_id, scenario, role, f"10.0.0.1:{port}", f"10.0.0.1:{port + 1}", "m")


@pytest.fixture(params=["memory", "zookeeper"])
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    """Opens clients of one fresh registry: a MemoryStore or a ZooKeeper root of its own."""
    if request.param == "memory":
        store = MemoryStore()
        open_client: Connect = lambda: MemoryRegistry(store)
    else:
        hosts = request.getfixturevalue("zookeeper")
        root = f"/test-{uuid.uuid4().hex[:12]}"
        open_client = lambda: ZooKeeperRegistry(hosts, root=root, timeout_s=5.0)
    clients: list[Registry] = []

    def connect_() -> Registry:
        clients.append(open_client())
        return clients[-1]

    yield connect_
    for client in clients:
        client.close()


def test_instances_are_listed_per_scenario_and_role(connect: Connect) -> None:
    writer, reader = connect(), connect()
    p0, p1 = make_instance("p0"), make_instance("p1")
    d0, s0 = make_instance("d0", role="decode"), make_instance("s0", scenario="search")
    for instance in (p1, d0, s0, p0):
        writer.register(instance)
    assert writer.instances("chat", "prefill") == [p0, p1]  # a client reads its own writes
    wait_until(lambda: reader.instances("chat", "prefill") == [p0, p1], "reader sees prefill")
    wait_until(lambda: reader.instances("search", "prefill") == [s0], "reader sees search")
    assert reader.instances("chat", "decode") == [d0]
    assert reader.instances("search", "decode") == []
    assert reader.instances("unknown", "prefill") == []
    assert reader.scenarios() == ["chat", "search"]


def test_registering_with_another_role_or_scenario_moves_the_instance(connect: Connect) -> None:
    writer, reader = connect(), connect()
    prefill = make_instance("i0")
    writer.register(prefill)
    decode = replace(prefill, role="decode")
    writer.register(decode)
    assert writer.instances("chat", "prefill") == []
    assert writer.instances("chat", "decode") == [decode]
    elsewhere = replace(decode, scenario="search", http="10.0.0.2:9000")
    writer.register(elsewhere)
    wait_until(lambda: reader.instances("search", "decode") == [elsewhere], "reader sees move")
    assert reader.instances("chat", "decode") == []
    assert reader.scenarios() == ["search"]


def test_a_register_replaces_the_same_id_registered_by_another_client(
        connect: Connect) -> None:
    """A restarted instance (a new session) moves the znode its predecessor left, found
    through its own cache of the registry rather than a scan of every scenario."""
    old, new = connect(), connect()
    for scenario in ("a", "b", "c"):
        old.register(make_instance(f"other-{scenario}", scenario=scenario))
    old.register(make_instance("i0", scenario="b"))
    wait_until(lambda: new.instances("b", "prefill")[:1] == [make_instance("i0", "b")],
               "the new client sees the old znode")
    moved = make_instance("i0", scenario="c", role="decode")
    new.register(moved)
    assert [i.instance_id for i in new.instances("b", "prefill")] == ["other-b"]
    wait_until(lambda: old.instances("c", "decode") == [moved], "the old client sees it")
    assert [i.instance_id for i in old.instances("b", "prefill")] == ["other-b"]


def test_unregister_removes_the_instance(connect: Connect) -> None:
    writer, reader = connect(), connect()
    keep, drop = make_instance("keep"), make_instance("drop", role="decode")
    writer.register(keep)
    writer.register(drop)
    wait_until(lambda: reader.instances("chat", "decode") == [drop], "reader sees drop")
    writer.unregister("drop")
    writer.unregister("never-registered")
    assert writer.instances("chat", "decode") == []
    wait_until(lambda: reader.instances("chat", "decode") == [], "reader sees removal")
    assert reader.instances("chat", "prefill") == [keep]


def test_closing_a_client_removes_only_its_instances(connect: Connect) -> None:
    leaving, staying = connect(), connect()
    gone, kept = make_instance("gone"), make_instance("kept")
    leaving.register(gone)
    staying.register(kept)
    wait_until(lambda: staying.instances("chat", "prefill") == [gone, kept], "both listed")
    leaving.close()
    wait_until(lambda: staying.instances("chat", "prefill") == [kept], "ephemeral entry gone")


def test_subscribers_hear_of_every_change(connect: Connect) -> None:
    writer, listener = connect(), connect()
    calls: list[int] = []
    changed = threading.Event()
    listener.subscribe(lambda: (calls.append(1), changed.set()))
    writer.register(make_instance("i0"))
    assert changed.wait(5.0), "no callback after register"
    changed.clear()
    writer.unregister("i0")
    assert changed.wait(5.0), "no callback after unregister"
    wait_until(lambda: listener.instances("chat", "prefill") == [], "removal seen")


def test_role_requests_reach_the_watching_instance(connect: Connect) -> None:
    controller, instance, other = connect(), connect(), connect()
    received: list[str] = []
    unrelated: list[str] = []
    instance.watch_role_requests("i0", received.append)
    other.watch_role_requests("i1", unrelated.append)
    controller.request_role("i0", "decode")
    wait_until(lambda: received == ["decode"], "first request delivered")
    controller.request_role("i0", "prefill")
    wait_until(lambda: received == ["decode", "prefill"], "second request delivered")
    late: list[str] = []
    connect().watch_role_requests("i0", late.append)
    wait_until(lambda: late == ["prefill"], "pending request delivered to a late watcher")
    assert unrelated == []


def test_an_instance_can_move_itself_from_its_role_callback(connect: Connect) -> None:
    controller, worker = connect(), connect()
    me = make_instance("i0")
    worker.register(me)
    durations: list[float] = []

    def move(role: str) -> None:
        start = time.monotonic()
        worker.register(replace(me, role=role))
        durations.append(time.monotonic() - start)

    worker.watch_role_requests("i0", move)
    controller.request_role("i0", "decode")
    wait_until(lambda: controller.instances("chat", "decode") == [replace(me, role="decode")],
               "instance moved")
    wait_until(lambda: len(durations) == 1, "callback finished")
    # A callback on kazoo's event thread would stall register() until its timeout.
    assert durations[0] < 2.0


BAD_NAMES = ["", ".", "..", "a/b", "/a", "tab\there", "nul\0"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_rejected(connect: Connect, name: str) -> None:
    registry = connect()
    with pytest.raises(ValueError, match="single path component"):
        make_instance(name)
    with pytest.raises(ValueError, match="single path component"):
        make_instance("i0", scenario=name)
    for call in (
        lambda: registry.unregister(name),
        lambda: registry.instances(name, "prefill"),
        lambda: registry.request_role(name, "decode"),
        lambda: registry.watch_role_requests(name, print),
    ):
        with pytest.raises(ValueError, match="single path component"):
            call()


def test_bad_roles_are_rejected(connect: Connect) -> None:
    registry = connect()
    with pytest.raises(ValueError, match="role must be one of"):
        make_instance("i0", role="mixed")
    with pytest.raises(ValueError, match="role must be one of"):
        registry.instances("chat", "Prefill")
    with pytest.raises(ValueError, match="role must be one of"):
        registry.request_role("i0", "both")


def test_instance_json_round_trip() -> None:
    instance = make_instance("i0", role="decode")
    assert Instance.from_json(instance.to_json()) == instance
    newer = instance.to_json().replace(b"{", b'{"added_later": 1, ', 1)
    assert Instance.from_json(newer) == instance
    for garbage in (b"[]", b"{}", b"not json", b'{"instance_id": "a/b"}'):
        with pytest.raises(ValueError):
            Instance.from_json(garbage)


def test_memory_url_shares_one_store_per_process() -> None:
    scenario = f"s-{uuid.uuid4().hex[:8]}"
    gateway, instance = make_registry("memory://"), make_registry("memory://")
    entry = make_instance("i0", scenario=scenario)
    instance.register(entry)
    assert gateway.instances(scenario, "prefill") == [entry]
    instance.close()
    assert gateway.instances(scenario, "prefill") == []
    gateway.close()


def test_zk_url_selects_hosts_and_root(zookeeper: str) -> None:
    from kazoo.client import KazooClient

    root = f"/custom-{uuid.uuid4().hex[:8]}"
    registry = make_registry(f"zk://{zookeeper},{zookeeper}{root}")
    raw = KazooClient(hosts=zookeeper)
    raw.start(timeout=5)
    try:
        instance = make_instance("i0")
        registry.register(instance)
        data, stat = raw.get(f"{root}/scenarios/chat/prefill/i0")
        assert Instance.from_json(data) == instance
        assert stat.ephemeralOwner != 0
        registry.request_role("i0", "decode")
        assert raw.get(f"{root}/control/i0/role")[0] == b"decode"
    finally:
        registry.close()
        raw.stop()
        raw.close()


@pytest.mark.parametrize(
    "url",
    ["", "memory:", "memory://x", "http://h:1", "zk://", "zk:///root", "zk://host",
     "zk://host:port", "zk://h:1,/r", "zk://h:1/a//b", "zk://h:1/a/../b"],
)
def test_make_registry_rejects_other_urls(url: str) -> None:
    with pytest.raises(ValueError, match="memory://"):
        make_registry(url)


def test_expired_session_registers_its_instances_again(zookeeper: str) -> None:
    from kazoo.client import KazooClient

    registry = ZooKeeperRegistry(zookeeper, root=f"/test-{uuid.uuid4().hex[:12]}", timeout_s=5.0)
    instance = make_instance("i0")
    registry.register(instance)
    path = registry._instance_path(instance)
    old_session = registry._client.client_id[0]
    # Closing a second client that took over the session expires it for the first.
    thief = KazooClient(hosts=zookeeper, client_id=registry._client.client_id)
    thief.start(timeout=5)
    thief.stop()
    thief.close()
    raw = KazooClient(hosts=zookeeper)
    raw.start(timeout=5)
    try:
        def owner() -> int | None:
            stat = raw.exists(path)
            return None if stat is None else stat.ephemeralOwner

        wait_until(lambda: owner() not in (None, old_session), "re-registered in a new session")
        wait_until(lambda: registry.instances("chat", "prefill") == [instance], "cache caught up")
    finally:
        registry.close()
        raw.stop()
        raw.close()


def test_unreachable_zookeeper_is_a_connection_error() -> None:
    pytest.importorskip("kazoo", reason="kazoo not installed; pip install -e '.[cluster]'")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    with pytest.raises(ConnectionError, match="cannot reach ZooKeeper"):
        ZooKeeperRegistry(f"127.0.0.1:{closed_port}", timeout_s=0.5)
