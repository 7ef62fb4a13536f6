"""Backends that turn one benchmark request into a timed record.

``HttpBackend`` streams from any OpenAI-compatible ``/v1/completions`` (pdserve, vLLM,
SGLang), so peers are measured by the same client. It uses aiohttp alone because the
GPU machine has no ``openai`` package. ``EngineBackend`` (engine_backend.py) drives an
in-process engine; both fill the same :class:`RequestRecord`, so the metrics code is shared.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

import aiohttp

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest

REQUEST_TIMEOUT_S = 6 * 3600


class Backend(Protocol):
    async def start(self) -> None: ...

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        """Sends ``request``; appends chunk times to ``record``; sets end_time and success."""

    async def close(self) -> None: ...


def completion_payload(model: str, request: BenchRequest) -> dict:
    return {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        # Fixed output length: an early EOS would change the load between engines.
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chunk_token_count(event: dict, choice: dict) -> int:
    """Tokens carried by one streamed choice: the count the server states (pdserve's
    ``num_tokens`` with ``return_engine_timing``, or ``token_ids``), else one per non-empty
    text (the vLLM / SGLang bench convention; a token held back as a partial character then
    merges into the next chunk, which per-token ITL cannot see)."""
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    if isinstance(event.get("num_tokens"), int):
        return event["num_tokens"]
    return 1 if choice.get("text") else 0


class HttpBackend:
    """Streams completions over HTTP from ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, model: str | None = None,
                 endpoint: str = "/v1/completions", extra_body: dict | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.extra_body = dict(extra_body or {})
        """Merged into every request, e.g. ``{"return_engine_timing": true}`` for pdserve."""
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # limit=0: an open-loop run must never queue requests inside the client.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        if self.model is None:
            self.model = await self.served_model()

    async def served_model(self) -> str:
        try:
            async with self.session.get(self.base_url + "/v1/models") as resp:
                data = await resp.json()
                return data["data"][0]["id"]
        except (aiohttp.ClientError, KeyError, IndexError, ValueError):
            return "default"

    async def engine_clock(self) -> float | None:
        """The server's timeline clock now; None when the server keeps no engine timeline
        (a peer engine, or an older pdserve)."""
        data = await self._timeline_query(1e300)  # a bound past every entry: just "now"
        return data.get("now") if data else None

    async def engine_timeline(self, since: float) -> list[dict]:
        """Every SM-split decision the engine made after ``since`` (its own clock)."""
        data = await self._timeline_query(since)
        return list(data.get("entries", [])) if data else []

    async def _timeline_query(self, since: float) -> dict | None:
        url = f"{self.base_url}/v1/engine/timeline"
        try:  # params= encodes the '+' of '1e+300', which a raw query would turn into a space
            async with self.session.get(url, params={"since": repr(since)}) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            return None

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        payload = {**completion_payload(self.model or "default", request), **self.extra_body}
        try:
            async with self.session.post(self.base_url + self.endpoint, json=payload) as resp:
                if resp.status != 200:
                    record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                await self._read_stream(resp, record)
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.end_time = time.perf_counter()

    async def _read_stream(self, resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            self._on_event(json.loads(data), now, record)
        record.success = not record.error and record.num_output_tokens > 0

    @staticmethod
    def _on_event(event: dict, now: float, record: RequestRecord) -> None:
        if "error" in event:
            record.error = str(event["error"])[:200]
            return
        for choice in event.get("choices") or []:
            count = chunk_token_count(event, choice)
            if count:
                record.add_chunk(now, count)
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
