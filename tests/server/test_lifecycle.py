"""API key, a full waiting queue and SIGTERM draining, on real servers (a dead engine:
test_restart.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from tests.server.conftest import engine_pid

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def guarded(launch):
    # One running request at a time and one waiting: the third concurrent request is refused.
    return launch("--max-num-seqs", "1", "--max-waiting", "1", "--retry-after", "2", api_key=KEY)


def test_api_key(guarded):
    assert guarded.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    status, _, body = guarded.request("POST", "/v1/completions", {"prompt": "x"},
                                      headers={"Authorization": ""})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0
                      ).models.list()
    assert guarded.openai().models.list().data[0].id == "tiny"
    assert guarded.request("GET", "/health", headers={"Authorization": ""})[0] == 200


async def _first_line(session: aiohttp.ClientSession, url: str, body: dict,
                      headers: dict | None = None) -> aiohttp.ClientResponse:
    resp = await session.post(url, json=body, headers=headers)
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    return resp


def _long(max_tokens: int = 3000) -> dict:
    return {"prompt": "long", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


def test_queue_full(guarded):
    url = guarded.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}

    async def run() -> None:
        async with aiohttp.ClientSession(headers=auth) as session:
            running = await _first_line(session, url, _long())
            waiting = asyncio.ensure_future(session.post(url, json=_long()))
            await asyncio.sleep(0.5)  # the engine has queued it
            async with session.post(url, json={"prompt": "x", "max_tokens": 2}) as third:
                assert third.status == 429
                assert third.headers["Retry-After"] == "2"
                assert (await third.json())["error"]["code"] == "queue_full"
            running.close()
            waiting.cancel()

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while guarded.metrics()["pdserve_kv_cache_usage_ratio"] > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_sigterm_drains_then_aborts(launch):
    server = launch("--shutdown-timeout", "4")
    url = server.url + "/v1/completions"
    engine = engine_pid(server)

    async def run() -> tuple[bytes, bytes]:
        async with aiohttp.ClientSession() as session:
            # Few tokens left to drain: on a loaded 2-core machine a step can take 300 ms.
            short = await _first_line(session, url, _long(max_tokens=4))
            long = await _first_line(session, url, _long())
            # To the engine too, as systemd's default stop signals the whole group: the
            # engine stays until the server has drained and tells it to stop.
            server.process.send_signal(signal.SIGTERM)
            os.kill(engine, signal.SIGTERM)
            await _expect_draining(session, server.url)
            return await short.content.read(), await long.content.read()

    short_rest, long_rest = asyncio.run(run())
    assert b'"finish_reason":"length"' in short_rest and short_rest.endswith(b"data: [DONE]\n\n")
    # Cut off at the shutdown timeout, by the server: the engine ran until then.
    assert b'"error"' in long_rest and b"the server is shutting down" in long_rest
    assert server.process.wait(30) == 0
    assert not os.path.exists(f"/proc/{engine}") or _is_zombie(engine)
    assert server.engine_pids() == []


async def _expect_draining(session: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + 3
    while True:
        async with session.get(base + "/health") as health:
            if health.status == 503:
                break
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    async with session.post(base + "/v1/completions", json={"prompt": "x"}) as refused:
        assert refused.status == 503


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
