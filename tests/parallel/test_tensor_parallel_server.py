"""``pdserve serve --tensor-parallel-size 2`` on the CPU over real HTTP: the engine process
(a daemon) starts its worker, reports the group size, serves; a worker killed stops the
engine, which the server restarts with a fresh worker."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.server.conftest import child_pids, engine_pid, start_server
from tests.server.test_restart import _wait_for_new_engine


def _worker_pid(engine: int) -> int:
    for pid in child_pids(engine):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"pdserve.engine.tp_worker" in f.read():
                return pid
    raise AssertionError(f"engine {engine} has no tensor-parallel worker")


@pytest.mark.slow
def test_serve_with_two_ranks_and_a_worker_killed():
    server = start_server("--tensor-parallel-size", "2", "--engine-restarts", "2",
                          "--engine-restart-backoff-s", "0.2")
    try:
        status, _, body = server.request("GET", "/v1/engine/info")
        assert status == 200 and json.loads(body)["tensor_parallel_size"] == 2
        done = server.openai().completions.create(model="tiny", prompt="hi", max_tokens=4,
                                                 extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4

        engine = engine_pid(server)
        os.kill(_worker_pid(engine), signal.SIGKILL)
        # The next launch finds the worker gone and the engine stops; the server restarts it.
        server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x",
                                                   "max_tokens": 2})
        _wait_for_new_engine(server, engine)
        assert "tensor-parallel rank 1" in server.log_text(), server.log_text()
        _worker_pid(engine_pid(server))  # the new engine has its own worker
        again = server.openai().completions.create(model="tiny", prompt="hi", max_tokens=4,
                                                 extra_body={"ignore_eos": True})
        assert again.usage.completion_tokens == 4
    finally:
        assert server.stop() == 0
