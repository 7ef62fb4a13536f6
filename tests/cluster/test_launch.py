"""`pdserve cluster`: a P/D group and its gateway from one command, answered through the
openai client, stopped by SIGTERM with no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.server.conftest import Server, child_pids, free_port, wait_healthy

pytestmark = pytest.mark.slow


def test_cluster_command_serves_and_stops_cleanly():
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "cluster", "tiny", "--prefill", "1", "--decode", "1",
           "--host", "127.0.0.1", "--port", str(port),
           "--serve-args", "--device cpu --dtype float32"]
    log = tempfile.TemporaryFile()
    cluster = Server(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port, log=log)
    try:
        wait_healthy(cluster, timeout=180)
        instances = child_pids(cluster.process.pid)
        assert len(instances) == 2
        stream = cluster.openai().completions.create(
            model="tiny", prompt="Hello", max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        pieces = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert pieces[-1].finish_reason == "length"
        cluster.process.send_signal(signal.SIGTERM)
        assert cluster.process.wait(60) == 0, cluster.log_text()
        assert not any(os.path.exists(f"/proc/{pid}") for pid in instances)  # reaped
        assert child_pids(cluster.process.pid) == []
    finally:
        if cluster.process.poll() is None:
            cluster.process.kill()
