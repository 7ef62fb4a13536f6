"""Cluster registry: which instance serves which scenario, in which role, at which address.

P/D-Serve keeps one prefill/decode group per scenario. Gateways route with this
map (``instances`` is read per request) and a ratio controller moves instances
between roles through it (``request_role`` / ``watch_role_requests``).

Two implementations of ``Registry``:

- ``MemoryRegistry``: in-process. Each object is one client ("session") of a
  ``MemoryStore``; clients of one store see each other, and closing a client
  drops the instances it registered, as a ZooKeeper session end would.
  ``make_registry("memory://")`` hands out clients of one process-wide store.
- ``ZooKeeperRegistry``: a kazoo client. ZooKeeper layout under ``root``
  (default ``/pdserve``)::

      <root>/scenarios/<scenario>/<role>/<instance_id>   ephemeral; Instance.to_json()
      <root>/control/<instance_id>/role                  persistent; requested role, UTF-8

  Instance znodes are ephemeral: they vanish when the session of the process
  that registered them ends. Scenario and role znodes are persistent and may
  stay empty; ``scenarios()`` lists only scenarios that have an instance.

ZooKeeper reads come from a local cache (a kazoo ``TreeCache`` over
``<root>/scenarios``). A client's own ``register`` / ``unregister`` returns
once its cache shows the change, so it reads its own writes; other clients'
changes arrive one watch round trip later. Connection loss: while SUSPENDED the
cache keeps its last view (the instances most likely still run, and routing to
them beats routing nowhere). After the session expired (LOST), ZooKeeper has
deleted this client's ephemeral znodes, and kazoo does not re-create them, so
on the next CONNECTED the client registers its instances again.

A role watcher gets the pending request at once, then each new one; requests
made in quick succession may reach a ZooKeeper watcher as only the latest
(watches re-read the znode), which is the one that counts.

Names are checked everywhere, reads included: a scenario, role or instance id
that is not a single path component raises ValueError (a gateway taking the
scenario from a request should answer 400 to it).

Callbacks (``subscribe``, ``watch_role_requests``) of a ``ZooKeeperRegistry``
run on one dispatcher thread per client, never on kazoo's threads, so a
callback may call the registry (an instance asked to move re-registers itself).
``MemoryRegistry`` runs them in the thread that made the change.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kazoo.recipe.cache import TreeCache, TreeEvent

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
URL_FORMS = "'memory://' or 'zk://host:port[,host:port...][/root]'"
DEFAULT_ROOT = "/pdserve"
# A move is scan-then-transaction; another client touching the same instance in
# between makes the transaction fail, and a fresh scan fixes it.
_ANNOUNCE_ATTEMPTS = 5


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _check_name(kind: str, name: str) -> None:
    # Names become znode path components: a '/' or '..' would address another
    # node, and ZooKeeper rejects control characters.
    valid = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
    if not (valid and name.isprintable()):
        raise ValueError(
            f"{kind} must be a single path component (non-empty, printable, "
            f"no '/', not '.' or '..'), got {name!r}"
        )


@dataclass(frozen=True)
class Instance:
    """One serving instance as gateways and controllers see it."""

    instance_id: str
    """Unique in the cluster; the key for moves and role requests."""
    scenario: str
    """The P/D group it serves."""
    role: str
    """"prefill" or "decode"."""
    http: str
    """"host:port" of its HTTP server."""
    kv: str
    """"host:port" of its KV receiver."""
    model: str = ""
    """Served model name."""
    schedule: str = ""
    """Its engine's ``--schedule``: a multiplexing decode instance may also take a prefill
    every prefill instance refused (the gateway's last resort)."""
    kv_transport: str = ""
    """Its ``--kv-transport`` (auto, tcp, ipc, p2p): what its receiver takes; the transport
    of each pair is agreed when the sender connects (``pdserve/transfer/links.py``)."""
    tensor_parallel_size: int = 1
    """GPUs its model is split across (``--tensor-parallel-size``); any prefill size pairs
    with any decode size (the KV buffer has every head, ``pdserve/transfer/heads.py``)."""

    def __post_init__(self) -> None:
        _check_name("instance_id", self.instance_id)
        _check_name("scenario", self.scenario)
        _check_role(self.role)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Instance:
        record = json.loads(data)
        if not isinstance(record, dict):
            raise ValueError(f"an Instance record is a JSON object, got {record!r}")
        # Unknown keys are dropped so that an older gateway still sees the
        # instances of a newer release that added a field.
        known = {field.name for field in fields(cls)}
        try:
            return cls(**{key: value for key, value in record.items() if key in known})
        except TypeError as exc:
            raise ValueError(f"not an Instance record: {exc}") from exc


@runtime_checkable
class Registry(Protocol):
    """The scenario -> role -> instances map shared by gateways, instances and controllers."""

    def register(self, instance: Instance) -> None:
        """(Re-)announce; the same instance_id with another role or scenario moves it."""
        ...

    def unregister(self, instance_id: str) -> None:
        """Remove the instance wherever it is; unknown ids are ignored."""
        ...

    def instances(self, scenario: str, role: str) -> list[Instance]:
        """Instances sorted by instance_id, from a local cache (cheap: called per request)."""
        ...

    def scenarios(self) -> list[str]:
        """Sorted scenarios that have at least one instance."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from any thread) after each membership change."""
        ...

    def request_role(self, instance_id: str, role: str) -> None:
        """Ask an instance to move to ``role``; the request persists until replaced."""
        ...

    def watch_role_requests(self, instance_id: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(role)`` for a pending request now, then for each new one."""
        ...

    def close(self) -> None:
        """End this client; the instances it registered vanish."""
        ...


def _call_safely(callback: Callable[..., Any], *args: Any) -> None:
    """A failing callback is logged: it must not break the change that triggered it."""
    try:
        callback(*args)
    except Exception:
        logger.exception("registry callback %r failed", callback)


_Index = dict[tuple[str, str], tuple[Instance, ...]]


def _build_index(instances: Iterable[Instance]) -> _Index:
    groups: dict[tuple[str, str], list[Instance]] = {}
    for instance in instances:
        groups.setdefault((instance.scenario, instance.role), []).append(instance)
    return {
        key: tuple(sorted(group, key=lambda instance: instance.instance_id))
        for key, group in groups.items()
    }


class _Directory:
    """Instances under arbitrary keys, plus a (scenario, role) index rebuilt lazily.

    Readers take the current index without the lock: a writer replaces it with
    None, never mutates it, so a reader sees an old or a new view, never half.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()  # over an RLock: compound updates nest
        self._entries: dict[str, Instance] = {}
        self._index: _Index | None = None

    def put(self, key: str, instance: Instance) -> bool:
        with self.lock:
            if self._entries.get(key) == instance:
                return False
            self._entries[key] = instance
            self._changed()
            return True

    def remove(self, key: str) -> Instance | None:
        with self.lock:
            instance = self._entries.pop(key, None)
            if instance is not None:
                self._changed()
            return instance

    def _changed(self) -> None:
        self._index = None
        self.lock.notify_all()

    def find(self, instance_id: str) -> list[Instance]:
        with self.lock:
            return [i for i in self._entries.values() if i.instance_id == instance_id]

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        with self.lock:
            return self.lock.wait_for(predicate, timeout_s)

    def index(self) -> _Index:
        index = self._index
        if index is None:
            with self.lock:
                if self._index is None:
                    self._index = _build_index(self._entries.values())
                index = self._index
        return index

    def instances(self, scenario: str, role: str) -> list[Instance]:
        _check_name("scenario", scenario)
        _check_role(role)
        return list(self.index().get((scenario, role), ()))

    def scenarios(self) -> list[str]:
        return sorted({scenario for scenario, _ in self.index()})


class MemoryStore:
    """The shared state behind the MemoryRegistry clients of one in-process 'cluster'."""

    def __init__(self) -> None:
        self.directory = _Directory()
        self.lock = self.directory.lock
        self.owners: dict[str, MemoryRegistry] = {}
        self.role_requests: dict[str, str] = {}
        self.subscribers: list[tuple[MemoryRegistry, Callable[[], None]]] = []
        self.role_watchers: list[tuple[MemoryRegistry, str, Callable[[str], None]]] = []

    def subscriber_callbacks(self) -> list[Callable[[], None]]:
        with self.lock:
            return [callback for _, callback in self.subscribers]


_SHARED_STORE = MemoryStore()


def _notify(callbacks: Iterable[Callable[[], None]]) -> None:
    for callback in callbacks:
        _call_safely(callback)


class MemoryRegistry:
    """In-process, thread-safe registry: one client of a MemoryStore (a fresh one by default)."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self._store = store if store is not None else MemoryStore()

    def register(self, instance: Instance) -> None:
        store = self._store
        with store.lock:
            store.owners[instance.instance_id] = self
            # Keyed by instance id, so a new role or scenario replaces the old entry.
            changed = store.directory.put(instance.instance_id, instance)
        if changed:
            _notify(store.subscriber_callbacks())

    def unregister(self, instance_id: str) -> None:
        _check_name("instance_id", instance_id)
        store = self._store
        with store.lock:
            store.owners.pop(instance_id, None)
            removed = store.directory.remove(instance_id) is not None
        if removed:
            _notify(store.subscriber_callbacks())

    def instances(self, scenario: str, role: str) -> list[Instance]:
        return self._store.directory.instances(scenario, role)

    def scenarios(self) -> list[str]:
        return self._store.directory.scenarios()

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._store.lock:
            self._store.subscribers.append((self, callback))

    def request_role(self, instance_id: str, role: str) -> None:
        _check_name("instance_id", instance_id)
        _check_role(role)
        store = self._store
        with store.lock:
            store.role_requests[instance_id] = role
            watchers = [cb for _, wid, cb in store.role_watchers if wid == instance_id]
        for callback in watchers:
            _call_safely(callback, role)

    def watch_role_requests(self, instance_id: str, callback: Callable[[str], None]) -> None:
        _check_name("instance_id", instance_id)
        store = self._store
        with store.lock:
            store.role_watchers.append((self, instance_id, callback))
            pending = store.role_requests.get(instance_id)
        if pending is not None:
            _call_safely(callback, pending)

    def close(self) -> None:
        store = self._store
        with store.lock:
            mine = [iid for iid, owner in store.owners.items() if owner is self]
            removed = [store.directory.remove(iid) for iid in mine]
            for iid in mine:
                del store.owners[iid]
            store.subscribers = [s for s in store.subscribers if s[0] is not self]
            store.role_watchers = [w for w in store.role_watchers if w[0] is not self]
        if any(instance is not None for instance in removed):
            _notify(store.subscriber_callbacks())


def _root_parts(root: str) -> tuple[str, ...]:
    if not isinstance(root, str) or not root.startswith("/"):
        raise ValueError(f"ZooKeeper root must be an absolute path like '/pdserve', got {root!r}")
    parts = tuple(root.strip("/").split("/")) if root.strip("/") else ()
    for part in parts:
        _check_name("ZooKeeper root component", part)
    return parts


class ZooKeeperRegistry:
    """Registry kept in ZooKeeper (layout in the module docstring); needs pdserve[cluster]."""

    def __init__(self, hosts: str, root: str = DEFAULT_ROOT, timeout_s: float = 10.0) -> None:
        """Connect now. ``timeout_s`` is the session timeout and the longest a call
        waits for the server or for the local cache to show its own write."""
        from kazoo.client import KazooClient  # optional extra: pdserve[cluster]

        self._root = _root_parts(root)
        self._timeout_s = timeout_s
        self._directory = _Directory()
        self._owned: dict[str, Instance] = {}  # guarded by self._directory.lock
        self._subscribers: list[Callable[[], None]] = []
        self._session_lost = False
        self._closed = False
        self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="pdserve-registry")
        self._client = KazooClient(hosts=hosts, timeout=timeout_s)
        self._client.add_listener(self._on_session_state)
        self._start_client(hosts)
        self._cache = self._start_cache()

    def _path(self, *parts: str) -> str:
        return "/" + "/".join((*self._root, *parts))

    def _instance_path(self, instance: Instance) -> str:
        return self._path("scenarios", instance.scenario, instance.role, instance.instance_id)

    def _start_client(self, hosts: str) -> None:
        from kazoo.handlers.threading import KazooTimeoutError

        try:
            self._client.start(timeout=self._timeout_s)
        except KazooTimeoutError as exc:
            # start() leaves kazoo retrying in the background; stop it for good.
            self._client.stop()
            self._client.close()
            self._dispatcher.shutdown(wait=False)
            raise ConnectionError(
                f"cannot reach ZooKeeper at {hosts!r} within {self._timeout_s} s"
            ) from exc
        self._client.ensure_path(self._path("scenarios"))
        self._client.ensure_path(self._path("control"))

    def _start_cache(self) -> TreeCache:
        from kazoo.recipe.cache import TreeCache, TreeEvent

        initialized = threading.Event()

        def on_event(event: TreeEvent) -> None:
            if event.event_type == TreeEvent.INITIALIZED:
                initialized.set()
            else:
                self._on_tree_event(event)

        cache = TreeCache(self._client, self._path("scenarios"))
        cache.listen(on_event)
        cache.listen_fault(lambda exc: logger.error("ZooKeeper registry cache: %r", exc))
        cache.start()
        if not initialized.wait(self._timeout_s):
            logger.warning("registry cache not filled within %s s; reads may miss instances",
                           self._timeout_s)
        return cache

    def _on_tree_event(self, event: TreeEvent) -> None:
        """Runs on the TreeCache thread, one event at a time."""
        from kazoo.recipe.cache import TreeEvent

        path = event.event_data.path if event.event_data is not None else ""
        if not self._is_instance_path(path):
            return  # scenario / role znodes, connection state changes
        if event.event_type == TreeEvent.NODE_REMOVED:
            changed = self._directory.remove(path) is not None
        elif event.event_type in (TreeEvent.NODE_ADDED, TreeEvent.NODE_UPDATED):
            instance = self._parse(path, event.event_data.data)
            changed = instance is not None and self._directory.put(path, instance)
        else:
            return
        if changed:
            with self._directory.lock:
                subscribers = list(self._subscribers)
            for callback in subscribers:
                self._dispatch(callback)

    def _dispatch(self, callback: Callable[..., None], *args: str) -> None:
        if not self._closed:  # the executor refuses work once close() shut it down
            self._dispatcher.submit(_call_safely, callback, *args)

    def _is_instance_path(self, path: str) -> bool:
        prefix = self._path("scenarios") + "/"
        return path.startswith(prefix) and path[len(prefix):].count("/") == 2

    def _parse(self, path: str, data: bytes | None) -> Instance | None:
        try:
            instance = Instance.from_json(data or b"")
        except ValueError as exc:
            logger.warning("ignoring registry znode %s: %s", path, exc)
            return None
        if self._instance_path(instance) != path:
            # The path is what routing and moves key on; a record that disagrees is corrupt.
            logger.warning("ignoring registry znode %s: it holds %s", path, instance)
            return None
        return instance

    def _on_session_state(self, state: str) -> None:
        """Runs on kazoo's connection thread, which must not block: re-announcing is spawned."""
        from kazoo.protocol.states import KazooState

        if state == KazooState.LOST:
            self._session_lost = True
        elif state == KazooState.CONNECTED and self._session_lost:
            self._session_lost = False
            self._client.handler.spawn(self._reannounce)

    def _reannounce(self) -> None:
        with self._directory.lock:
            owned = list(self._owned.values())
        for instance in owned:
            if self._closed:
                return
            try:
                self._announce(instance)
            except Exception:
                logger.exception("re-registering %s after session expiry failed",
                                 instance.instance_id)
        logger.info("ZooKeeper session expired; re-registered %d instances", len(owned))

    def _paths_on_server(self, instance_id: str, scan: bool = True) -> list[str]:
        """Where ZooKeeper holds instance_id now (normally zero or one place): every
        scenario and role asked (two round trips per scenario), or with ``scan=False``
        only the places the local cache shows it (it holds every instance znode)."""
        if scan:
            scenarios = self._client.get_children(self._path("scenarios"))
            candidates = [
                self._path("scenarios", scenario, role, instance_id)
                for scenario in scenarios
                for role in ROLES
            ]
        else:
            candidates = [self._instance_path(i) for i in self._directory.find(instance_id)]
        pending = [self._client.exists_async(path) for path in candidates]
        found = zip(candidates, pending, strict=True)
        return [path for path, result in found if result.get() is not None]

    def _announce(self, instance: Instance) -> None:
        """Replace every znode of this instance id by one at its new place, atomically.

        The delete + create run as one transaction, so a reader never sees the
        instance in two roles or in none; re-creating even an unchanged znode
        makes it ephemeral to this session, not to a dead predecessor's.
        """
        path = self._instance_path(instance)
        self._client.ensure_path(path.rsplit("/", 1)[0])
        failures: list[Exception] = []
        for attempt in range(_ANNOUNCE_ATTEMPTS):
            transaction = self._client.transaction()
            # First where the cache shows the instance: a scan of every scenario made one
            # register cost 400 round trips with 200 scenarios. A transaction that fails
            # (the cache was behind) retries with the full scan.
            for old_path in self._paths_on_server(instance.instance_id, scan=attempt > 0):
                transaction.delete(old_path)
            transaction.create(path, instance.to_json(), ephemeral=True)
            failures = [r for r in transaction.commit() if isinstance(r, Exception)]
            if not failures:
                return
        raise RuntimeError(f"could not register {instance.instance_id!r}: {failures!r}")

    def _await_cache(self, predicate: Callable[[], bool], what: str) -> None:
        if not self._directory.wait_for(predicate, self._timeout_s):
            logger.warning("registry cache did not show %s within %s s", what, self._timeout_s)

    def register(self, instance: Instance) -> None:
        with self._directory.lock:
            self._owned[instance.instance_id] = instance
        try:
            self._announce(instance)
        except Exception:
            with self._directory.lock:
                self._owned.pop(instance.instance_id, None)
            raise
        self._await_cache(
            lambda: self._directory.find(instance.instance_id) == [instance],
            f"registration of {instance.instance_id!r}",
        )

    def unregister(self, instance_id: str) -> None:
        from kazoo.exceptions import NoNodeError

        _check_name("instance_id", instance_id)
        with self._directory.lock:
            self._owned.pop(instance_id, None)
        for path in self._paths_on_server(instance_id):
            try:
                self._client.delete(path)
            except NoNodeError:
                pass  # another client removed or moved it first
        self._await_cache(
            lambda: not self._directory.find(instance_id), f"removal of {instance_id!r}"
        )

    def instances(self, scenario: str, role: str) -> list[Instance]:
        return self._directory.instances(scenario, role)

    def scenarios(self) -> list[str]:
        return self._directory.scenarios()

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._directory.lock:
            self._subscribers.append(callback)

    def request_role(self, instance_id: str, role: str) -> None:
        from kazoo.exceptions import NodeExistsError

        _check_name("instance_id", instance_id)
        _check_role(role)
        path = self._path("control", instance_id, "role")
        try:
            self._client.create(path, role.encode(), makepath=True)
        except NodeExistsError:
            self._client.set(path, role.encode())

    def watch_role_requests(self, instance_id: str, callback: Callable[[str], None]) -> None:
        from kazoo.recipe.watchers import DataWatch

        _check_name("instance_id", instance_id)

        # Three parameters on purpose: kazoo retries a callback with two
        # arguments when it raises TypeError, which would run it twice.
        def on_data(data: bytes | None, stat: object, event: object = None) -> None:
            if data is None:
                return  # no request yet
            role = data.decode(errors="replace")
            if role not in ROLES:
                logger.warning("ignoring role request %r for %s", role, instance_id)
                return
            self._dispatch(callback, role)

        DataWatch(self._client, self._path("control", instance_id, "role"), on_data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._directory.lock:
            self._owned.clear()
        self._cache.close()
        # stop() ends the session, so ZooKeeper drops this client's ephemeral
        # znodes now rather than after the session timeout.
        self._client.stop()
        self._client.close()
        self._dispatcher.shutdown(wait=False, cancel_futures=True)


def _parse_zk_url(url: str) -> tuple[str, str]:
    """'zk://h1:p1,h2:p2/root' -> ('h1:p1,h2:p2', '/root')."""
    hosts, _, path = url.removeprefix("zk://").partition("/")
    if not hosts or not all(_is_host_port(host) for host in hosts.split(",")):
        raise ValueError(f"registry URL must be {URL_FORMS}, got {url!r}")
    root = "/" + path.rstrip("/") if path.rstrip("/") else DEFAULT_ROOT
    try:
        _root_parts(root)
    except ValueError as exc:
        raise ValueError(f"registry URL must be {URL_FORMS}, got {url!r}: {exc}") from exc
    return hosts, root


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def make_registry(url: str) -> Registry:
    """'memory://' (a client of the process-wide MemoryStore) or 'zk://hosts[/root]'."""
    if url == "memory://":
        return MemoryRegistry(_SHARED_STORE)
    if isinstance(url, str) and url.startswith("zk://"):
        hosts, root = _parse_zk_url(url)
        return ZooKeeperRegistry(hosts, root)
    raise ValueError(f"registry URL must be {URL_FORMS}, got {url!r}")
