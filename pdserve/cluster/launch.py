"""``pdserve cluster``: one P/D group in one command - N prefill and M decode instances
(``pdserve serve`` processes, one GPU each when there are GPUs) behind a gateway; on this
machine, or placed on a Ray cluster with ``--ray-address`` (``ray_launch.py``).

With the default ``memory://`` registry the launcher lists the instances in the gateway's
own registry and carries out the ratio controller's moves itself; with ``zk://`` each
instance joins the group in ZooKeeper on its own (``--role``), as on a real cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace

from pdserve.cluster.app import start_gateway, stop_gateway
from pdserve.cluster.config import GatewayConfig
from pdserve.cluster.registry import Instance, Registry, make_registry
from pdserve.server.pd import SECRET_ENV, resolve_secret, secret_headers
from pdserve.signals import die_with_parent

log = logging.getLogger("pdserve.launch")
HEALTH_TIMEOUT_S = 900.0


@dataclass
class Member:
    role: str
    port: int
    process: subprocess.Popen  # or what stands for a remote one (``ray_launch.RayProcess``)
    gpu: str | None
    host: str = "127.0.0.1"

    @property
    def http(self) -> str:
        return f"{self.host}:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_list(text: str | None) -> list[str]:
    """``--gpus`` as GPU ids (None or empty: none listed)."""
    return [g for g in text.split(",") if g] if text else []


def gpu_groups(gpus: list[str], num_instances: int, group_size: int) -> list[str | None]:
    """Each instance's CUDA_VISIBLE_DEVICES: ``group_size`` distinct GPUs, handed out in turn
    (instances share GPUs when there are fewer than they need); None on a machine without."""
    if not gpus:
        return [None] * num_instances
    if len(gpus) < group_size:
        raise ValueError(f"--tensor-parallel-size {group_size} needs {group_size} GPUs per "
                         f"instance; --gpus lists {len(gpus)}")
    return [",".join(gpus[(i * group_size + k) % len(gpus)] for k in range(group_size))
            for i in range(num_instances)]


def spawn_members(model: str, num_prefill: int, num_decode: int, serve_args: list[str],
                  gpus: list[str], registry_url: str, scenario: str,
                  secret: str | None = None, tensor_parallel_size: int = 1) -> list[Member]:
    """Starts the instances; ``secret`` reaches them in the environment (not in ``ps``)."""
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    members = []
    for role, gpu in zip(roles, gpu_groups(gpus, len(roles), tensor_parallel_size), strict=True):
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve", "serve", model, "--host", "127.0.0.1",
               "--port", str(port), "--kv-transfer-port", "0", *serve_args]
        if tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if registry_url.startswith("zk://"):
            cmd += ["--role", role, "--registry", registry_url, "--scenario", scenario]
        env = dict(os.environ)
        if secret:
            env[SECRET_ENV] = secret
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        # A process group of its own: Ctrl-C (or kill -- -PGID) reaches only this launcher,
        # which drains the gateway first and then stops each member once; a member that got
        # the signal too would count the launcher's as a second one and cut its own drain.
        # It still stops (SIGTERM) if the launcher dies.
        process = subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=die_with_parent)
        members.append(Member(role, port, process, gpu))
    return members


def wait_ready(members: list[Member], secret: str | None = None,
               timeout_s: float = HEALTH_TIMEOUT_S) -> dict[int, dict]:
    """Each member's ``/pd/info`` (by ``Member.http``) once it is healthy; raises if one
    dies or times out."""
    infos, deadline = {}, time.monotonic() + timeout_s
    while len(infos) < len(members):
        for member in members:
            if member.http in infos:
                continue
            if member.process.poll() is not None:
                raise RuntimeError(f"the {member.role} instance at {member.http} exited "
                                   f"with code {member.process.returncode}")
            info = _info(member.http, secret)
            if info is not None:
                infos[member.http] = info
        if time.monotonic() > deadline:
            raise RuntimeError(f"instances not ready within {timeout_s:.0f} s")
        time.sleep(0.2)
    return infos


def _info(http: str, secret: str | None) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://{http}/health", timeout=2) as resp:
            if resp.status != 200:
                return None
        request = urllib.request.Request(f"http://{http}/pd/info",
                                         headers=secret_headers(secret))
        with urllib.request.urlopen(request, timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def list_members(registry: Registry, members: list[Member], infos: dict[int, dict],
                 scenario: str) -> None:
    """Registers the members on their behalf (memory registry) and follows role requests."""
    for member in members:
        info = infos[member.http]
        instance = Instance(member.http, scenario, member.role, member.http,
                            info["kv_address"], info["model"], info.get("schedule", ""),
                            tensor_parallel_size=info.get("tensor_parallel_size", 1))
        registry.register(instance)
        registry.watch_role_requests(instance.instance_id, _mover(registry, instance))


def _mover(registry: Registry, instance: Instance):
    current = [instance]

    def move(role: str) -> None:
        current[0] = replace(current[0], role=role)
        registry.register(current[0])

    return move


def stop_members(members: list[Member], timeout_s: float = 60.0) -> None:
    for member in members:
        if member.process.poll() is None:
            member.process.send_signal(signal.SIGTERM)
    for member in members:
        try:
            member.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            member.process.kill()


async def run_cluster(args: argparse.Namespace, gateway_config: GatewayConfig) -> None:
    gpus = gpu_list(args.gpus)
    # One command, one group: a fresh secret guards its internal routes unless one is given.
    secret = resolve_secret(gateway_config.cluster_secret) or secrets.token_urlsafe(32)
    gateway_config = replace(gateway_config, cluster_secret=secret)
    if args.ray_address:
        from pdserve.cluster.ray_launch import spawn_ray_members

        members = spawn_ray_members(args, args.serve_args, gateway_config.registry,
                                    gateway_config.default_scenario, secret)
    else:
        members = spawn_members(args.model, args.prefill, args.decode, args.serve_args, gpus,
                                gateway_config.registry, gateway_config.default_scenario,
                                secret, args.tensor_parallel_size)
    try:
        infos = await asyncio.get_running_loop().run_in_executor(None, wait_ready, members,
                                                                 secret)
        registry = make_registry(gateway_config.registry)
        if not gateway_config.registry.startswith("zk://"):
            list_members(registry, members, infos, gateway_config.default_scenario)
        runner, gateway, ratio = await start_gateway(gateway_config, registry)
        await _wait_for_signal()
        await stop_gateway(runner, gateway, ratio)
        registry.close()
    finally:
        stop_members(members)
        if args.ray_address:
            import ray

            ray.shutdown()


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="tiny", help="Model for every instance.")
    parser.add_argument("--prefill", type=int, default=1, help="Prefill instances.")
    parser.add_argument("--decode", type=int, default=1, help="Decode instances.")
    parser.add_argument("--gpus", default=None, help="Comma-separated GPU ids handed out to "
                        "instances in turn (CUDA_VISIBLE_DEVICES); default: the machine's.")
    parser.add_argument("--serve-args", type=shlex.split, default=[],
                        help="Extra flags for every `pdserve serve`, as one string.")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs of each "
                        "instance (one tensor-parallel group each; on this machine taken in "
                        "turn from --gpus, with --ray-address one node's bundle).")
    ray = parser.add_argument_group("Ray (pip install 'pdserve[ray]')")
    ray.add_argument("--ray-address", default=None, help="Place the instances on this "
                     "existing Ray cluster (e.g. HEAD_IP:6379, or 'auto'), one placement "
                     "group each, instead of on this machine; the gateway stays here.")
    ray.add_argument("--ray-prefill-resources", default=None, metavar="JSON",
                     help="With --ray-address: custom Ray resources each prefill instance's "
                     "bundle asks for, e.g. '{\"prefill_pool\": 1}'.")
    ray.add_argument("--ray-decode-resources", default=None, metavar="JSON",
                     help="With --ray-address: the same for each decode instance.")


def default_gpus() -> str | None:
    """One GPU per instance when this machine has several; None lets them share."""
    try:
        import torch
    except ImportError:
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ",".join(str(i) for i in range(count)) if count > 1 else None
