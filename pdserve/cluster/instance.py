"""An instance's membership of a P/D group: announce it in the registry once it serves,
follow the ratio controller's role requests, leave before draining."""

from __future__ import annotations

import logging
from dataclasses import replace

from pdserve.cluster.config import InstanceConfig
from pdserve.cluster.registry import ROLES, Instance, make_registry

log = logging.getLogger("pdserve.instance")


class GroupMembership:
    """The server's ``Lifecycle``: registers at start, unregisters at shutdown."""

    def __init__(self, config: InstanceConfig, http_port: int, model: str) -> None:
        if config.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, not {config.role!r}")
        self.config = config
        self.http = f"{config.advertise_host}:{http_port}"
        self.model = model
        self.registry = None
        self.instance: Instance | None = None

    def started(self, client) -> None:
        if client.kv_address is None:
            raise RuntimeError("a P/D instance needs --kv-transfer-port")
        kv_port = client.kv_address.rpartition(":")[2]
        self.instance = Instance(self.config.instance_id or self.http, self.config.scenario,
                                 self.config.role, self.http,
                                 f"{self.config.advertise_host}:{kv_port}", self.model,
                                 client.setup.get("schedule", ""),
                                 client.setup.get("kv_transport", ""),
                                 client.setup.get("tensor_parallel_size", 1))
        self.registry = make_registry(self.config.registry)
        self.registry.register(self.instance)
        self.registry.watch_role_requests(self.instance.instance_id, self._move)
        log.info("joined scenario %s as %s (%s)", self.instance.scenario, self.instance.role,
                 self.instance.instance_id)

    def _move(self, role: str) -> None:
        if self.instance is None or role == self.instance.role:
            return
        log.info("moving from %s to %s", self.instance.role, role)
        self.instance = replace(self.instance, role=role)
        self.registry.register(self.instance)

    def stopping(self) -> None:
        if self.registry is None:
            return
        self.registry.unregister(self.instance.instance_id)
        self.registry.close()
        self.registry = None
