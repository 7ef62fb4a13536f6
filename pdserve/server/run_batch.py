"""``pdserve run-batch``: a file of OpenAI batch requests answered offline, one output line
per input line, in the input's order (the OpenAI Batch API's JSONL, as ``vllm run-batch``
reads and writes it).

Each line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``BATCH_URLS``. The lines run through the same HTTP server ``pdserve serve`` runs, listening
on a loopback port of its own, so a body is read, checked and answered exactly as the
server would answer it; the engine batches the lines in flight like any concurrent
requests (up to ``--max-concurrent-requests`` at once). With ``--server-url`` the lines go
to a running server or P/D gateway instead, nothing loaded here.

Every input line gets one output line: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}`` for an answer of the server (a 400's error body
included), or ``"response": null`` and ``"error": {"code", "message"}`` for a line that
could not be sent at all (not JSON, a field missing, another method or URL, a stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.model.generation_config import sampling_defaults
from pdserve.progress import progress
from pdserve.server.client import EngineClient, RestartPolicy
from pdserve.server.config import ServerConfig
from pdserve.server.engine_process import DEFAULT_CORE

logger = logging.getLogger("pdserve.run_batch")

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
BUSY_TRIES = 5
REMOTE_CONCURRENCY = 256
"""Lines in flight at once to a running server (its own limit answers the rest with 429,
which would be written as their answers)."""
LINE_ERROR = "invalid_batch_line"


class BatchLineError(ValueError):
    """An input line that cannot be sent: its output line carries this message (and the
    line's ``custom_id`` where it has a readable one)."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


@dataclass(frozen=True)
class BatchLine:
    index: int
    custom_id: str
    url: str
    body: dict


def read_line(index: int, text: str) -> BatchLine:
    """One input line as a request to send; ``BatchLineError`` naming what is wrong."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"line {index + 1} is not JSON: {exc.msg}") from None
    if not isinstance(line, dict):
        raise BatchLineError(f"line {index + 1} is not a JSON object")
    custom_id = line.get("custom_id")
    problem = _line_problem(line)
    if problem is not None:
        raise BatchLineError(f"line {index + 1}: {problem}",
                             custom_id if isinstance(custom_id, str) else None)
    return BatchLine(index, custom_id, line["url"], line["body"])


def _line_problem(line: dict) -> str | None:
    """Why a line (a JSON object) cannot be sent; None when it can."""
    custom_id, method, url, body = (line.get(k) for k in ("custom_id", "method", "url", "body"))
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        return f"unknown field '{unknown[0]}'"
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    if method != "POST":
        return f"'method' must be \"POST\", not {method!r}"
    if url not in BATCH_URLS:
        return f"'url' {url!r} is not one of {', '.join(BATCH_URLS)}"
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    if body.get("stream"):
        return "'stream' is not supported in a batch: each answer is written whole"
    return None


def answered(line: BatchLine, status: int, body: Any, request_id: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def unsent(custom_id: str | None, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": LINE_ERROR, "message": message}}


class OrderedWriter:
    """Output lines written in the input's order as they come: a line waits only for the
    lines before it (memory bounded by how far answers run out of order)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.next_index = 0
        self.waiting: dict[int, dict] = {}

    def add(self, index: int, output: dict) -> None:
        self.waiting[index] = output
        while self.next_index in self.waiting:
            self.stream.write(json.dumps(self.waiting.pop(self.next_index)) + "\n")
            self.next_index += 1


@dataclass
class BatchSummary:
    lines: int = 0
    succeeded: int = 0
    failed: int = 0
    seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def count(self, output: dict) -> None:
        response = output["response"]
        ok = response is not None and response["status_code"] == 200
        self.succeeded += ok
        self.failed += not ok
        if not ok:
            key = LINE_ERROR if response is None else str(response["status_code"])
            self.failures[key] = self.failures.get(key, 0) + 1


async def input_lines(source: str, session: aiohttp.ClientSession) -> AsyncIterator[str]:
    """The non-blank lines of a local file, of stdin (``-``) or of an http(s) URL (GET)."""
    if source.startswith(("http://", "https://")):
        async with session.get(source) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                if raw.strip():
                    yield raw.decode("utf-8")
        return
    if source == "-":  # a pipe may wait on its writer: read it off the event loop
        while text := await asyncio.to_thread(sys.stdin.readline):
            if text.strip():
                yield text
        return
    with open(source, encoding="utf-8") as stream:
        for text in stream:
            if text.strip():
                yield text


async def send(session: aiohttp.ClientSession, base_url: str, line: BatchLine,
               tries: int = BUSY_TRIES) -> dict:
    """The server's answer to one line (an error status included: its body says why). A
    busy server's 429 or 503 is tried again after its Retry-After, ``tries`` times in all:
    a batch is in no hurry, and the answer written is the last one."""
    for attempt in range(tries):
        async with session.post(base_url + line.url, json=line.body) as resp:
            status, text = resp.status, await resp.text()
            retry_after = resp.headers.get("Retry-After", "1")
        if status not in (429, 503) or attempt == tries - 1:
            break
        await asyncio.sleep(float(retry_after) if retry_after.isdigit() else 1.0)
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = text
    request_id = body.get("id") if isinstance(body, dict) and status == 200 else None
    return answered(line, status, body, request_id or f"req_{uuid.uuid4().hex}")


async def run_lines(source: str, out, base_url: str, concurrency: int,
                    api_key: str | None = None) -> BatchSummary:
    """Sends every line of ``source`` to the server at ``base_url`` (at most
    ``concurrency`` at once, with ``api_key`` as its bearer token) and writes the output
    lines to ``out``."""
    summary, writer = BatchSummary(), OrderedWriter(out)
    gate, tasks, seen = asyncio.Semaphore(concurrency), set(), set()
    started = time.monotonic()
    bar = progress(desc="batch", unit="req")

    def finish(index: int, output: dict) -> None:
        summary.count(output)
        writer.add(index, output)
        bar.update()

    async def one(line: BatchLine) -> None:
        try:
            output = await send(session, base_url, line)
        except aiohttp.ClientError as exc:  # the server's own answer is never lost here
            output = unsent(line.custom_id, f"the request failed: {exc}")
        finally:
            gate.release()
        finish(line.index, output)

    timeout = aiohttp.ClientTimeout(total=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        index = 0
        async for text in input_lines(source, session):
            try:
                line = read_line(index, text)
                if line.custom_id in seen:
                    raise BatchLineError(f"line {index + 1}: 'custom_id' {line.custom_id!r} "
                                         "is used by an earlier line", line.custom_id)
            except BatchLineError as exc:
                finish(index, unsent(exc.custom_id, str(exc)))
            else:
                seen.add(line.custom_id)
                await gate.acquire()
                task = asyncio.ensure_future(one(line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            index += 1
        if tasks:
            await asyncio.gather(*tasks)
    bar.close()
    summary.lines, summary.seconds = index, time.monotonic() - started
    return summary


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """The app listening on a free port of 127.0.0.1 only: the batch's own server."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here: its port is known, and no other can take it
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"


class OutputFile:
    """Where the output lines go: a local file (written beside it, then moved into place,
    so a failed run never leaves half a file under the name), stdout (``-``) or an http(s)
    URL (written to a temporary file, then PUT there)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.is_url = target.startswith(("http://", "https://"))
        folder = None if self.is_url or target == "-" else os.path.dirname(
            os.path.abspath(target))
        self.stream = sys.stdout if target == "-" else tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w", encoding="utf-8", dir=folder, suffix=".jsonl.part", delete=False)

    async def finish(self) -> None:
        if self.stream is sys.stdout:
            self.stream.flush()
            return
        self.stream.close()
        if not self.is_url:
            os.replace(self.stream.name, self.target)
            return
        try:
            async with aiohttp.ClientSession() as session:
                with open(self.stream.name, "rb") as data:
                    async with session.put(self.target, data=data) as resp:
                        resp.raise_for_status()
        finally:
            os.unlink(self.stream.name)

    def discard(self) -> None:
        if self.stream is not sys.stdout:
            self.stream.close()
            os.unlink(self.stream.name)


async def run_batch(engine_config: Any, config: ServerConfig, source: str, target: str,
                    core_factory: str = DEFAULT_CORE) -> BatchSummary:
    """Loads the model, answers every line of ``source`` and writes ``target``."""
    from pdserve.server.app import build_app, start_stats_log

    output = OutputFile(target)
    client = await EngineClient.start(engine_config, core_factory, config.engine_start_timeout,
                                      RestartPolicy(config.engine_restarts,
                                                    config.engine_restart_backoff_s))
    try:
        model = engine_config.model
        app = build_app(client, config, api_keys=(),
                        sampling_defaults=sampling_defaults(model.generation_config,
                                                            model.model))
        runner, base_url = await serve_on_loopback(app)
        stats_lines = start_stats_log(client, config)
        try:
            summary = await run_lines(source, output.stream, base_url,
                                      config.max_concurrent_requests)
        finally:
            if stats_lines is not None:
                stats_lines.cancel()
            await runner.cleanup()
    except BaseException:
        output.discard()
        raise
    finally:
        await client.shutdown()
    await output.finish()
    return summary


async def run_remote_batch(base_url: str, api_key: str | None, source: str, target: str,
                           concurrency: int = REMOTE_CONCURRENCY) -> BatchSummary:
    """Every line of ``source`` sent to a running server or P/D gateway at ``base_url``."""
    output = OutputFile(target)
    try:
        summary = await run_lines(source, output.stream, base_url.rstrip("/"), concurrency,
                                  api_key)
    except BaseException:
        output.discard()
        raise
    await output.finish()
    return summary


def main(engine_config: Any, config: ServerConfig, source: str, target: str) -> int:
    """``pdserve run-batch``: runs the batch and logs what came of it."""
    return _run_and_log(lambda: run_batch(engine_config, config, source, target), target)


def main_remote(base_url: str, api_key: str | None, source: str, target: str) -> int:
    """``pdserve run-batch --server-url``: the batch through a running server."""
    return _run_and_log(lambda: run_remote_batch(base_url, api_key, source, target), target)


def _run_and_log(batch, target: str) -> int:
    from pdserve.server.app import run_event_loop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    summary = BatchSummary()

    async def go() -> None:
        nonlocal summary
        summary = await batch()

    run_event_loop(go())
    failures = ", ".join(f"{n} x {why}" for why, n in sorted(summary.failures.items()))
    logger.info("batch: %d line(s) in %.1f s: %d answered with 200, %d not%s; written to %s",
                summary.lines, summary.seconds, summary.succeeded, summary.failed,
                f" ({failures})" if failures else "", target)
    return 0
