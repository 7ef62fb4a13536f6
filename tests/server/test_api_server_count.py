"""``pdserve serve --api-server-count 2``: two real HTTP processes in front of one engine,
reached over real sockets. New connections are spread over the processes by the kernel
(SO_REUSEPORT); every answer names its process in the X-PDServe-Api-Server header, so each
test opens fresh connections until it has what it needs on each process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import pytest

from pdserve.testing import free_port
from tests.server.conftest import Server, child_pids, wait_healthy

pytestmark = pytest.mark.slow

HEADER = "X-PDServe-Api-Server"
BOTH = {"0", "1"}
FLAGS = ("--dtype", "float32", "--device", "cpu", "--num-blocks", "512",
         "--max-num-seqs", "64")
DEADLINE_S = 60


def _start(*flags: str) -> Server:
    """A server in a session of its own, so that a test can Ctrl-C its whole group."""
    port = free_port()
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "pdserve", "serve", "tiny", "--host", "127.0.0.1", "--port",
           str(port), "--api-server-count", "2", *FLAGS, *flags]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    server = Server(process, port, log=log)
    wait_healthy(server)
    return server


@pytest.fixture(scope="module")
def multi():
    server = _start()
    yield server
    server.stop()


def _session() -> aiohttp.ClientSession:
    # A connection per request: the kernel picks the process per connection.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))


def _stream_body(prompt: str, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[str, int, str | None]:
    """The text, the usage's completion tokens and the finish reason of an SSE answer."""
    texts, tokens, finish = [], None, None
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            texts.append(choice["text"])
            finish = choice["finish_reason"] or finish
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return "".join(texts), tokens, finish


async def _one_stream(session, base: str, prompt: str) -> tuple[str | None, tuple]:
    async with session.post(base + "/v1/completions", json=_stream_body(prompt, 12)) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers.get(HEADER), await _read_stream(resp)


PROMPTS = [f"client {i}: " + "abcdefgh"[: i % 8] * (i % 5 + 1) for i in range(24)]


async def _all_streams(base: str) -> list[tuple[str | None, tuple]]:
    async with _session() as session:
        return await asyncio.gather(*(_one_stream(session, base, p) for p in PROMPTS))


def test_concurrent_streams_on_two_processes_match_one_process(multi, server):
    two = asyncio.run(_all_streams(multi.url))
    one = asyncio.run(_all_streams(server.url))
    assert {process for process, _ in two} == BOTH  # both processes served some
    assert {process for process, _ in one} == {None}  # one process: no header
    # Greedy: the same prompt gives the same tokens whichever process and batch it ran in;
    # a token lost, doubled or sent to another stream would change its text or count.
    assert [answer for _, answer in two] == [answer for _, answer in one]
    assert all(tokens == 12 and finish == "length" for _, (_, tokens, finish) in two)


def _scrape(server: Server) -> tuple[str, dict[str, float]]:
    """One /metrics answer on a fresh connection: the process that gave it, its values."""
    status, headers, body = server.request("GET", "/metrics")
    assert status == 200, body
    values = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return headers[HEADER], values


def _until_both(server: Server, check) -> dict[str, dict[str, float]]:
    """Scrapes until an answer from each process passes ``check`` (a request's figures
    reach the engine process as it finishes, a moment after its last byte)."""
    passed: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while passed.keys() != BOTH:
        process, values = _scrape(server)
        if check(values):
            passed[process] = values
        assert time.monotonic() < deadline, (passed.keys(), values)
    return passed


FINISHED = 'pdserve_requests_finished_total{finish_reason="length"}'
TTFT = "pdserve_time_to_first_token_seconds_count"
ITL = "pdserve_inter_token_latency_seconds_count"
E2E = "pdserve_e2e_request_latency_seconds_count"
ERRORS_400 = 'pdserve_request_errors_total{status="400"}'
RUNNING = "pdserve_num_requests_running"
GENERATED = "pdserve_generation_tokens_total"


async def _plain_requests(base: str, count: int, max_tokens: int) -> list[str]:
    body = {"model": "tiny", "prompt": "count me", "max_tokens": max_tokens,
            "ignore_eos": True}
    async with _session() as session:
        async def one() -> str:
            async with session.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return resp.headers[HEADER]

        return await asyncio.gather(*(one() for _ in range(count)))


def test_metrics_count_every_process_requests_from_either(multi):
    _, first = _scrape(multi)
    # Settled: both processes show the same sums (the last test's streams are all in).
    before = _until_both(multi, lambda v: v.get(FINISHED, 0) == first.get(FINISHED, 0))
    base = before["0"]
    served = asyncio.run(_plain_requests(multi.url, 16, 5))
    assert set(served) == BOTH
    for _ in range(4):
        assert multi.request("POST", "/v1/completions", {"prompt": "x", "bogus": 1})[0] == 400

    def counted(values: dict[str, float]) -> bool:
        grown = {name: values.get(name, 0) - base.get(name, 0)
                 for name in (FINISHED, TTFT, ITL, E2E, ERRORS_400)}
        return grown == {FINISHED: 16, TTFT: 16, ITL: 16 * 4, E2E: 16, ERRORS_400: 4}

    after = _until_both(multi, counted)
    names = ('vllm:request_success_total{finished_reason="length",model_name="tiny"}',
             'vllm:time_to_first_token_seconds_count{model_name="tiny"}')
    assert after["0"][names[0]] - base.get(names[0], 0) == 16
    assert after["1"][names[1]] - base.get(names[1], 0) == 16


async def _open_on_each(session, base: str, max_tokens: int
                        ) -> dict[str, aiohttp.ClientResponse]:
    """A running stream on each process (streams that landed twice are closed)."""
    streams: dict[str, aiohttp.ClientResponse] = {}
    deadline = time.monotonic() + DEADLINE_S
    while streams.keys() != BOTH:
        assert time.monotonic() < deadline
        resp = await session.post(base + "/v1/completions",
                                  json=_stream_body("stream on each", max_tokens))
        assert resp.status == 200
        await resp.content.readline()  # the first chunk: the engine runs it
        if resp.headers[HEADER] in streams:
            resp.close()
        else:
            streams[resp.headers[HEADER]] = resp
    return streams


def test_running_gauge_and_a_gone_client_on_either_process(multi):
    _until_both(multi, lambda v: v[RUNNING] == 0)

    async def run() -> None:
        # Scraped from a thread: this loop must go on running to close a connection.
        async def until_both(check) -> dict[str, dict[str, float]]:
            return await asyncio.to_thread(_until_both, multi, check)

        async with _session() as session:
            streams = await _open_on_each(session, multi.url, 3000)
            # Each process counts the other's stream: the gauge is the whole server's.
            await until_both(lambda v: v[RUNNING] == 2)
            streams["1"].close()  # the client of process 1 hangs up
            after_abort = await until_both(lambda v: v[RUNNING] == 1)
            # ... and the engine goes on with process 0's request alone.
            generated = max(v[GENERATED] for v in after_abort.values())
            await until_both(lambda v: v[RUNNING] == 1 and v[GENERATED] >= generated + 5)
            streams["0"].close()
        await until_both(lambda v: v[RUNNING] == 0)

    asyncio.run(run())


def test_models_health_and_info_are_the_same_on_either_process(multi):
    answers: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while answers.keys() != BOTH:
        assert time.monotonic() < deadline
        status, headers, body = multi.request("GET", "/v1/models")
        health = multi.request("GET", "/health")
        info = json.loads(multi.request("GET", "/v1/engine/info")[2])
        answers.setdefault(headers[HEADER], {"models": (status, json.loads(body)),
                                             "health": health[0],
                                             "engine": (info["engine_pid"], info["schedule"])})
    assert answers["0"] == answers["1"]
    assert answers["0"]["health"] == 200 and answers["0"]["models"][0] == 200


def _worker_pids(server: Server) -> list[int]:
    engine = json.loads(server.request("GET", "/v1/engine/info")[2])["engine_pid"]
    return [pid for pid in child_pids(server.process.pid) if pid != engine
            and b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_gone(pids: list[int]) -> None:
    """Every process of the server leaves (multiprocessing's resource tracker a moment
    after the first process: it leaves when that one's end of its pipe closes)."""
    deadline = time.monotonic() + DEADLINE_S
    while left := [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["SIGTERM to the process group",
                                 "SIGINT to the process group"])
def test_a_signal_drains_every_process_then_stops_them_all(how):
    server = _start()
    everyone = [server.process.pid, *child_pids(server.process.pid)]

    async def run() -> list[tuple[str, int, str | None]]:
        async with _session() as session:
            streams = await _open_on_each(session, server.url, 16)
            # Ctrl-C, or systemd's default stop: every process of the group gets the
            # signal; the first passes it on once, the others must not count it again.
            sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
            os.killpg(server.process.pid, sig)
            return [await _read_stream(resp) for resp in streams.values()]

    try:
        finished = asyncio.run(run())
        assert server.process.wait(60) == 0, server.log_text()
    finally:
        server.stop()
    # Both drained to their end, neither cut short.
    assert [(tokens, finish) for _, tokens, finish in finished] == [(16, "length")] * 2
    _all_gone(everyone)


def test_a_dead_http_process_stops_the_server_after_the_others_drain():
    server = _start()
    (worker,) = _worker_pids(server)
    everyone = [server.process.pid, *child_pids(server.process.pid)]

    async def run() -> tuple[str, int, str | None]:
        async with _session() as session:
            streams = await _open_on_each(session, server.url, 48)
            os.kill(worker, signal.SIGKILL)
            return await _read_stream(streams["0"])

    try:
        _, tokens, finish = asyncio.run(run())
        code = server.process.wait(60)
    finally:
        server.stop()
    log = server.log_text()
    assert code == 1, log
    # The engine dropped only the dead process's request: process 0's ran to its end.
    assert (tokens, finish) == (48, "length")
    assert f"HTTP process 1 (pid {worker}) exited unexpectedly (code -9)" in log
    _all_gone(everyone)


def test_a_killed_first_process_leaves_no_process_behind():
    server = _start()
    everyone = [server.process.pid, *child_pids(server.process.pid)]
    assert len(everyone) >= 3  # the first process, the engine, the other HTTP process
    server.process.kill()
    server.process.wait(60)
    # The other process sees its control pipe close and stops; the engine stops once
    # every channel has closed.
    _all_gone(everyone)


def test_a_dead_engine_stops_every_process_with_the_reason():
    server = _start("--engine-restarts", "3")
    engine = json.loads(server.request("GET", "/v1/engine/info")[2])["engine_pid"]
    everyone = [server.process.pid, *child_pids(server.process.pid)]
    os.kill(engine, signal.SIGKILL)
    try:
        code = server.process.wait(60)
    finally:
        server.stop()
    log = server.log_text()
    assert code == 1, log
    assert "engine restarts are off with --api-server-count 2" in log
    assert "pdserve serve: the engine process is gone (the engine process exited); restarts " \
        "are off with --api-server-count > 1" in log
    _all_gone(everyone)


@pytest.mark.parametrize("flags, says", [
    (("--api-server-count", "0"), "--api-server-count must be an integer >= 1, not 0"),
    (("--api-server-count", "-2"), "--api-server-count must be an integer >= 1, not -2"),
    (("--api-server-count", "two"), "--api-server-count: invalid int value: 'two'"),
    (("--api-server-count", "2", "--port", "0"), "--api-server-count 2 needs a fixed --port"),
    (("--api-server-count", "2", "--role", "prefill"), "--role takes --api-server-count 1"),
])
def test_bad_api_server_count_stops_before_the_model_loads(flags, says):
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", "tiny", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "model loaded" not in done.stderr and "Traceback" not in done.stderr
