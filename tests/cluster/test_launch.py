"""`pdserve cluster`: a P/D group and its gateway from one command, answered through the
openai client, stopped by Ctrl-C to its process group (a stream in flight drained to its
end) with no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from pdserve.cluster.launch import gpu_groups
from tests.cluster.conftest import late_bound_port
from tests.server.conftest import Server, child_pids, wait_healthy

pytestmark = pytest.mark.slow


def test_cluster_command_serves_and_stops_cleanly():
    """Each instance a tensor-parallel group (two processes over gloo on the CPU): the launcher
    differs from size 1 only by passing the flag on, and the group's worker processes must be
    reaped too. Size 1 instances are what every other cluster test starts."""
    tp = 2
    port = late_bound_port()
    cmd = [sys.executable, "-m", "pdserve", "cluster", "tiny", "--prefill", "1", "--decode", "1",
           "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp),
           "--serve-args", "--device cpu --dtype float32"]
    log = tempfile.TemporaryFile()
    # A session of its own, so that the test can Ctrl-C the command's process group.
    cluster = Server(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True), port, log=log)
    try:
        wait_healthy(cluster, timeout=180)
        instances = child_pids(cluster.process.pid)
        assert len(instances) == 2
        stream = cluster.openai().completions.create(
            model="tiny", prompt="Hello", max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        pieces = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert pieces[-1].finish_reason == "length"
        groups = json.loads(cluster.request("GET", "/cluster/groups")[2])["groups"]
        sizes = [i["tensor_parallel_size"] for g in groups.values() for role in g.values()
                 for i in role]
        assert sizes == [tp, tp]
        # Ctrl-C mid-stream reaches every process of the group, tensor-parallel ranks
        # included: only the launcher acts on it, and the instances drain the stream.
        stream = cluster.openai().completions.create(
            model="tiny", prompt="Hello", max_tokens=100, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        first = next(iter(stream))
        os.killpg(cluster.process.pid, signal.SIGINT)
        rest = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert first.choices and rest[-1].finish_reason == "length", cluster.log_text()
        assert cluster.process.wait(60) == 0, cluster.log_text()
        assert not any(os.path.exists(f"/proc/{pid}") for pid in instances)  # reaped
        assert child_pids(cluster.process.pid) == []
    finally:
        if cluster.process.poll() is None:
            cluster.process.kill()


def test_gpus_are_handed_out_in_groups_of_the_tensor_parallel_size():
    assert gpu_groups(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert gpu_groups(["0", "1", "2", "3"], 3, 2) == ["0,1", "2,3", "0,1"]  # shared in turn
    assert gpu_groups(["0", "1"], 3, 1) == ["0", "1", "0"]
    assert gpu_groups([], 2, 4) == [None, None]  # the CPU: gloo processes
    with pytest.raises(ValueError, match="needs 2 GPUs per instance; --gpus lists 1"):
        gpu_groups(["0"], 2, 2)
