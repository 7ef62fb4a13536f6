"""The engine process SIGKILLed under a real server: in-flight requests fail with a
retryable error, /health says 503 until a new engine is ready, then new requests are served;
past ``--engine-restarts`` the server exits non-zero and says why."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.server.conftest import engine_pid, wait_engine_idle

pytestmark = pytest.mark.slow

LONG = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True}


def _wait_for_new_engine(server, old_pid: int, timeout: float = 120) -> int:
    """The new engine's pid once /health is 200 with it (a 200 right after the kill can
    still be the server not having seen the old one go)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log_text()
        pid = engine_pid(server, missing_ok=True)
        if pid not in (None, old_pid) and server.request("GET", "/health")[0] == 200:
            return pid
        time.sleep(0.1)
    raise AssertionError("no new engine:\n" + server.log_text())


async def _in_flight_then_kill(server) -> tuple[int, dict, dict, bytes, int]:
    """A stream and a plain request both running when the engine is killed: what each got,
    and /health right after."""
    url = server.url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        stream = await session.post(url, json={**LONG, "stream": True})
        assert stream.status == 200
        await stream.content.readline()  # the first chunk: the engine runs it
        plain = asyncio.ensure_future(session.post(url, json=LONG))
        while server.metrics()["pdserve_num_requests_running"] < 2:
            await asyncio.sleep(0.05)
        os.kill(engine_pid(server), signal.SIGKILL)
        refused = await plain
        body = await refused.json()
        rest = await stream.content.read()
        async with session.get(server.url + "/health") as health:
            return refused.status, dict(refused.headers), body, rest, health.status


def test_killed_engine_is_restarted_and_in_flight_requests_fail_retryably(launch):
    # The backoff (plus a model load) keeps the engine down long enough to see it down.
    server = launch("--engine-restarts", "2", "--engine-restart-backoff-s", "1")
    old_pid = engine_pid(server)
    status, headers, body, rest, health = asyncio.run(_in_flight_then_kill(server))
    assert status == 503 and "Retry-After" in headers, body
    assert body["error"]["type"] and "engine" in body["error"]["message"]
    events = [line for line in rest.decode().split("\n\n") if line]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "engine" in error["message"] and events[-1] == "data: [DONE]"
    assert health == 503
    refused = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert refused[0] == 503 and "Retry-After" in refused[1]

    _wait_for_new_engine(server, old_pid)
    # Sampled at temperature 1: the random tiny model may draw its EOS (not what this checks).
    done = server.openai().completions.create(model="tiny", prompt="after", max_tokens=4,
                                              extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    wait_engine_idle(server)  # the new engine's pages all free again
    assert "engine restarted" in server.log_text()
    assert server.stop() == 0


def test_server_gives_up_after_its_restarts_and_exits_non_zero(launch):
    server = launch("--engine-restarts", "1", "--engine-restart-backoff-s", "0.2")
    first = engine_pid(server)
    os.kill(first, signal.SIGKILL)
    second = _wait_for_new_engine(server, first)
    os.kill(second, signal.SIGKILL)  # within 60 s of the restart: the second in a row
    assert server.process.wait(60) != 0
    log = server.log_text()
    assert "pdserve serve: the engine process is gone (the engine process exited); it died " \
        "or failed to load after 1 restart(s) in a row" in log
    assert server.engine_pids() == []


@pytest.mark.parametrize("flag, value", [("--engine-restarts", "-1"),
                                         ("--engine-restart-backoff-s", "nan")])
def test_bad_restart_flags_stop_before_the_model_loads(flag, value):
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "tiny", flag, value],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and flag in done.stderr and "model loaded" not in done.stderr
