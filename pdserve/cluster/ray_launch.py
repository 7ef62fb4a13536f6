"""``pdserve cluster --ray-address ADDR``: the P/D group's instances placed on an existing Ray
cluster, one placement group per instance, the gateway on this machine.

Each instance's placement group has one bundle: ``--tensor-parallel-size`` GPUs when the
cluster has GPUs (one instance, or one tensor-parallel group, per bundle, so its GPUs are
on one node), else as many CPUs; plus the custom resources of its role
(``--ray-prefill-resources`` / ``--ray-decode-resources``, e.g. to keep prefill and decode
on different node pools). A small actor in that bundle starts ``pdserve serve`` on its
node (Ray sets ``CUDA_VISIBLE_DEVICES`` to the bundle's GPUs), on a free port of that node,
binding and advertising the node's address, and stops it with the launcher. The registry
(ZooKeeper for instances on several hosts) and the gateway are what they are without Ray.

Ray is imported only here, so the one-machine launcher runs without it
(``pip install 'pdserve[ray]'``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

from pdserve.server.pd import SECRET_ENV
from pdserve.signals import die_with_parent

log = logging.getLogger("pdserve.launch")
READY_TIMEOUT_S = 600.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray-address needs Ray: pip install 'pdserve[ray]'") from None
    return ray


def parse_resources(text: str | None, flag: str) -> dict[str, float]:
    """A JSON object of Ray resource names to amounts; ValueError naming ``flag``."""
    if not text:
        return {}
    try:
        resources = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg})") from None
    good = isinstance(resources, dict) and all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
        for k, v in resources.items())
    if not good:
        raise ValueError(f"{flag}: give a JSON object of resource names to positive "
                         f"amounts, like '{{\"prefill_pool\": 1}}'")
    return resources


def ray_args_refusal(args: Any) -> str | None:
    """Why the Ray flags of ``pdserve cluster`` cannot work, checked before anything starts."""
    ray_only = {"--ray-prefill-resources": args.ray_prefill_resources is not None,
                "--ray-decode-resources": args.ray_decode_resources is not None}
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be at least 1, not {args.tensor_parallel_size}"
    if not args.ray_address:
        given = [flag for flag, set_ in ray_only.items() if set_]
        return f"{', '.join(given)} needs --ray-address" if given else None
    if args.gpus is not None:
        return "--gpus is for this machine; with --ray-address, Ray hands out the GPUs"
    try:
        parse_resources(args.ray_prefill_resources, "--ray-prefill-resources")
        parse_resources(args.ray_decode_resources, "--ray-decode-resources")
        import_ray()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


class InstanceHost:
    """The Ray actor that runs one ``pdserve serve`` on its node (defined as a plain class;
    ``ray.remote`` wraps it when the launcher runs, so importing this needs no Ray)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(self, cmd: list[str], env: dict[str, str]) -> tuple[str, int, str]:
        """Starts the server on a free port of this node; (node address, port, node id)."""
        import ray

        from pdserve.cluster.launch import free_port

        host, port = self.node_address(), free_port()
        full = [sys.executable, "-m", "pdserve", "serve", *cmd, "--host", host, "--port",
                str(port), "--kv-transfer-host", host, "--advertise-host", host]
        # Dies with this actor's process: a launcher killed outright leaves no server.
        self.process = subprocess.Popen(full, env={**os.environ, **env},
                                        preexec_fn=die_with_parent)
        return host, port, ray.get_runtime_context().get_node_id()

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class RayProcess:
    """A remote instance seen through the ``subprocess.Popen`` calls the launcher uses."""

    def __init__(self, ray: Any, actor: Any, group: Any) -> None:
        self.ray, self.actor, self.group = ray, actor, group
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.ray.get(self.actor.poll.remote())
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass  # stop() in wait() sends SIGTERM and waits in one round trip

    def wait(self, timeout: float | None = None) -> int | None:
        self.returncode = self.ray.get(self.actor.stop.remote(timeout or 60.0))
        self.ray.kill(self.actor)
        self.ray.util.remove_placement_group(self.group)
        return self.returncode

    def kill(self) -> None:
        self.ray.kill(self.actor)


def bundle_for(ray: Any, tensor_parallel: int, extra: dict[str, float]) -> dict[str, float]:
    """One instance's bundle: its GPUs (or a CPU on a cluster without GPUs) and ``extra``."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus and tensor_parallel > gpus:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel}: the Ray cluster has "
                         f"{gpus:g} GPUs")
    base = {"GPU" if gpus else "CPU": float(tensor_parallel)}  # a CPU per rank without GPUs
    return {**base, **extra}


def place_instance(ray: Any, role: str, bundle: dict[str, float], cmd: list[str],
                   env: dict[str, str]) -> tuple[str, int, RayProcess]:
    """Reserves the bundle, starts the instance's actor in it: (node address, port, handle)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([bundle], strategy="STRICT_PACK", name=f"pdserve-{role}")
    try:
        ray.get(group.ready(), timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"Ray could not place a {role} instance needing {bundle} within "
                           f"{READY_TIMEOUT_S:.0f} s") from None
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    actor_cls = ray.remote(InstanceHost).options(
        num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        scheduling_strategy=strategy)
    actor = actor_cls.remote()
    host, port, node = ray.get(actor.start.remote(cmd, env))
    log.info("%s instance placed by Ray on node %s at %s:%d (%s)", role, node, host, port,
             json.dumps(bundle, sort_keys=True))
    return host, port, RayProcess(ray, actor, group)


def spawn_ray_members(args: Any, serve_args: list[str], registry_url: str, scenario: str,
                      secret: str | None) -> list[Any]:
    """Connects to the Ray cluster and places every instance; ``Member``s of the launcher."""
    from pdserve.cluster.launch import Member

    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=args.ray_address, logging_level=logging.WARNING,
                 log_to_driver=False)
    extra = {"prefill": parse_resources(args.ray_prefill_resources, "--ray-prefill-resources"),
             "decode": parse_resources(args.ray_decode_resources, "--ray-decode-resources")}
    env = {SECRET_ENV: secret} if secret else {}
    members = []
    for role in ["prefill"] * args.prefill + ["decode"] * args.decode:
        cmd = [args.model, "--kv-transfer-port", "0", *serve_args]
        if registry_url.startswith("zk://"):
            cmd += ["--role", role, "--registry", registry_url, "--scenario", scenario]
        if args.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        bundle = bundle_for(ray, args.tensor_parallel_size, extra[role])
        host, port, process = place_instance(ray, role, bundle, cmd, env)
        members.append(Member(role, port, process, None, host))
    return members
