"""`pdserve cluster --ray-address`: a real two-node Ray cluster started by the test on this
machine (its own temp dir and ports), a 1P+1D group of tiny CPU instances placed through
Ray placement groups (custom resources put prefill on one node and decode on the other),
a real ZooKeeper registry, served through the gateway: the text equals one instance's."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.conftest import late_bound_port
from tests.server.conftest import Server, free_port, wait_healthy

try:
    import ray
except ImportError:  # the refusals below need no Ray; the cluster test skips
    ray = None
REPO = Path(__file__).resolve().parents[2]
NODE_CPUS = 2
BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}


def _ray_start(temp_dir: str, cpus: int, *flags: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [shutil.which("ray") or "ray", "start", "--temp-dir", temp_dir, "--num-cpus", str(cpus),
           "--object-store-memory", str(80 << 20), "--disable-usage-stats", *flags]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _processes_of(temp_dir: str) -> set[int]:
    """Every process this test's Ray started: those naming its temp dir on their command
    line, and their descendants (workers and agents rename themselves)."""
    parents, roots = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if temp_dir.encode() in command:
            roots.add(int(entry))
    tree, grew = set(roots), True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return tree


def _stop_ray(temp_dir: str) -> None:
    # Not `ray stop`: it stops every Ray on the machine, a user's own cluster included.
    for pid in _processes_of(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """Two nodes of two CPUs, shared by the module's launches: a bundle asks for a CPU per
    tensor-parallel rank on a cluster without GPUs, so a group of two fits a node; each
    launch gives its placement groups back when it stops (the next waits for them)."""
    pytest.importorskip("ray", reason="Ray not installed; pip install -e '.[ray]'")
    # Short: Ray's socket paths under it must fit a Unix socket name.
    temp_dir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")
    port = free_port()
    try:
        _ray_start(temp_dir, NODE_CPUS, "--head", "--port", str(port), "--include-dashboard",
                   "false", "--resources", json.dumps({"pd_prefill": 1}))
        address = f"{ray.util.get_node_ip_address()}:{port}"
        _ray_start(temp_dir, NODE_CPUS, "--address", address, "--resources",
                   json.dumps({"pd_decode": 1}))
        yield address
    finally:
        _stop_ray(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _nodes_with(address: str) -> dict[str, str]:
    """Node id -> the custom resource that marks it (pd_prefill or pd_decode)."""
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return {node["NodeID"]: mark for node in ray.nodes() if node["Alive"]
                for mark in node["Resources"] if mark.startswith("pd_")}
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_places_prefill_and_decode_on_their_nodes_and_the_gateway_serves(
        ray_cluster, zookeeper):
    """Each instance a tensor-parallel group of two processes in its bundle: the launcher
    differs from size 1 only by the flag it passes on and the bundle's CPUs (a multiple)."""
    tp = 2
    gateway_port = late_bound_port()
    cmd = [sys.executable, "-m", "pdserve", "cluster", "tiny", "--prefill", "1", "--decode",
           "1", "--ray-address", ray_cluster, "--registry", f"zk://{zookeeper}/ray-test-{tp}",
           "--tensor-parallel-size", str(tp),
           "--ray-prefill-resources", '{"pd_prefill": 1}',
           "--ray-decode-resources", '{"pd_decode": 1}',
           "--host", "127.0.0.1", "--port", str(gateway_port),
           "--serve-args", "--device cpu --dtype float32"]
    log = tempfile.TemporaryFile()
    cluster = Server(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                     gateway_port, log=log)
    try:
        wait_healthy(cluster, timeout=240)
        placed = {role: (node, http) for role, node, http in re.findall(
            r"(prefill|decode) instance placed by Ray on node (\w+) at (\S+) \(",
            cluster.log_text())}
        nodes = _nodes_with(ray_cluster)
        assert nodes[placed["prefill"][0]] == "pd_prefill"
        assert nodes[placed["decode"][0]] == "pd_decode"
        split = _complete_until_served(cluster)
        groups = json.loads(cluster.request("GET", "/cluster/groups")[2])["groups"]
        assert [i["tensor_parallel_size"] for g in groups.values() for role in g.values()
                for i in role] == [tp, tp]
        alone = _complete_at(placed["prefill"][1])  # the prefill instance, asked directly
        assert split["choices"][0]["text"] == alone["choices"][0]["text"]
        assert split["usage"]["completion_tokens"] == BODY["max_tokens"]
        cluster.process.send_signal(signal.SIGTERM)
        assert cluster.process.wait(120) == 0, cluster.log_text()
    finally:
        if cluster.process.poll() is None:
            cluster.process.kill()


def _complete_at(http: str) -> dict:
    request = urllib.request.Request(f"http://{http}/v1/completions",
                                     data=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _complete_until_served(cluster: Server, timeout_s: float = 120.0) -> dict:
    """The gateway answers 503 until the ZooKeeper registry shows it both instances."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, _, raw = cluster.request("POST", "/v1/completions", BODY)
        if status == 200 or time.monotonic() > deadline:
            assert status == 200, raw
            return json.loads(raw)
        time.sleep(0.25)


@pytest.mark.parametrize("flags, reason", [
    (["--ray-prefill-resources", '{"pool": 1}'], "--ray-prefill-resources needs --ray-address"),
    (["--tensor-parallel-size", "3"], "does not divide the model's 4 attention heads"),
    (["--tensor-parallel-size", "2", "--gpus", "0"], "needs 2 GPUs per instance"),
    (["--ray-address", "auto", "--ray-decode-resources", "[1]"],
     "--ray-decode-resources: give a JSON object"),
    (["--ray-address", "auto", "--ray-prefill-resources", "{"],
     "--ray-prefill-resources: not JSON"),
    (["--ray-address", "auto", "--gpus", "0,1"], "with --ray-address, Ray hands out the GPUs"),
])
def test_ray_flags_that_cannot_work_stop_before_anything_starts(flags, reason):
    done = subprocess.run([sys.executable, "-m", "pdserve", "cluster", "tiny", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and reason in done.stderr, done.stderr


def test_without_ray_the_launcher_loads_and_ray_address_says_how_to_get_it():
    # ``sys.modules["ray"] = None`` makes ``import ray`` fail, as on an install without it.
    script = ("import sys; sys.modules['ray'] = None; import pdserve.cluster.launch; "
              "from pdserve.cli import main; "
              "sys.exit(main(['cluster', 'tiny', '--ray-address', '10.0.0.1:6379']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--ray-address needs Ray: pip install 'pdserve[ray]'" in done.stderr
