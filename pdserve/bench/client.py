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

from pdserve.bench.metrics import APPROXIMATE_SOURCE, RequestRecord
from pdserve.bench.workloads import BenchError, BenchRequest

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
        # continuous_usage_stats (vLLM, SGLang): every chunk states the tokens so far.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


PDSERVE_EXTRA_BODY = {"return_engine_timing": True}
"""Sent to a pdserve server unless --extra-body says otherwise: every chunk then states its
token count (``num_tokens``), even a chunk whose text is held back."""


class ChunkCounter:
    """Tokens in each streamed choice, from the first exact count the stream carries:
    a running ``usage`` (continuous usage stats), ``logprobs`` (one entry per token),
    ``token_ids``, pdserve's ``num_tokens``; else one per chunk with text (``text``,
    approximate: a token held back as a partial character merges into a later chunk)."""

    def __init__(self) -> None:
        self.usage_so_far = 0

    def count(self, event: dict, choice: dict) -> tuple[int, str]:
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            new = usage["completion_tokens"] - self.usage_so_far
            self.usage_so_far = usage["completion_tokens"]
            return new, "usage"
        logprob_tokens = _logprob_tokens(choice.get("logprobs"))
        if logprob_tokens is not None:
            return len(logprob_tokens), "logprobs"
        if isinstance(choice.get("token_ids"), list):
            return len(choice["token_ids"]), "token_ids"
        if isinstance(event.get("num_tokens"), int):
            return event["num_tokens"], "num_tokens"
        return (1 if _choice_text(choice) else 0), APPROXIMATE_SOURCE


def _logprob_tokens(logprobs) -> list | None:
    """Completions carry ``tokens``, chat ``content``: one entry per token either way."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens", logprobs.get("content"))
    return tokens if isinstance(tokens, list) else None


def _choice_text(choice: dict) -> str:
    """A chunk's text, a reasoning model's thought included (its deltas come before any
    content, and their tokens are output too; servers send it as ``reasoning``,
    ``reasoning_content`` or both)."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return choice.get("text") or ""
    return (delta.get("content") or "") + (delta.get("reasoning")
                                           or delta.get("reasoning_content") or "")


class HttpBackend:
    """Streams completions over HTTP from ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base_url: str, model: str | None = None,
                 endpoint: str = "/v1/completions", extra_body: dict | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.extra_body = None if extra_body is None else dict(extra_body)
        """Merged into every request; None: ``PDSERVE_EXTRA_BODY`` for pdserve, else nothing."""
        self.owned_by: str | None = None
        """The server's ``owned_by`` for the model (``pdserve`` for ours)."""
        self.session: aiohttp.ClientSession | None = None

    engine_info: dict | None = None
    """A pdserve server's ``/v1/engine/info`` (schedule, partitions, predictor): results
    record what actually ran."""

    async def fetch_engine_info(self) -> dict | None:
        """``/v1/engine/info`` now (None from a server without it): after a run it holds
        what the engine learned (multiplexing's calibration) and its counters."""
        try:
            async with self.session.get(self.base_url + "/v1/engine/info") as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            return None

    async def start(self) -> None:
        # limit=0: an open-loop run must never queue requests inside the client.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        card = await self.model_card()
        self.owned_by = card.get("owned_by")
        if self.model is None and not card.get("id"):
            await self.close()
            raise BenchError(f"{self.base_url}/v1/models lists no model: pass --model NAME")
        self.model = self.model or card["id"]
        if self.extra_body is None:
            self.extra_body = dict(PDSERVE_EXTRA_BODY) if self.owned_by == "pdserve" else {}
        if self.owned_by == "pdserve":
            self.engine_info = await self.fetch_engine_info()

    async def model_card(self) -> dict:
        """The first ``/v1/models`` entry ({} when the server has no such list); a server
        that cannot be reached is an error here, before any request is sent."""
        try:
            async with self.session.get(self.base_url + "/v1/models") as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else {}
        except aiohttp.ClientConnectionError as exc:
            await self.close()
            raise BenchError(f"cannot reach {self.base_url}: {exc}") from None
        except ValueError:
            return {}
        cards = data.get("data") if isinstance(data, dict) else None
        first = cards[0] if isinstance(cards, list) and cards else None
        return first if isinstance(first, dict) else {}

    async def engine_clock(self) -> float | None:
        """The server's timeline clock now; None when the server keeps no engine timeline
        (a peer engine, or an older pdserve)."""
        data = await self._timeline_query(1e300)  # a bound past every entry: just "now"
        return data.get("now") if data else None

    async def engine_timeline(self, since: float) -> list[dict]:
        """The engine's timeline after ``since`` (its own clock): decisions or steps."""
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
        payload = {**completion_payload(self.model, request), **(self.extra_body or {})}
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
        counter = ChunkCounter()
        async for raw in resp.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            _on_event(json.loads(data), now, record, counter)
        if not record.error and not record.chunk_times:
            record.error = _no_token_error(record.output_tokens)
        record.success = not record.error


def _no_token_error(reported_tokens: int | None) -> str:
    if reported_tokens:
        # Only when counting text chunks: every token's text was held back or empty.
        return (f"the server reports {reported_tokens} tokens, but no chunk had text or a "
                "token count (no TTFT)")
    return "the stream ended without a token"


def _on_event(event: dict, now: float, record: RequestRecord, counter: ChunkCounter) -> None:
    if "error" in event:
        record.error = str(event["error"])[:200]
        return
    for choice in event.get("choices") or []:
        count, source = counter.count(event, choice)
        if count > 0:
            record.add_chunk(now, count, source)
    usage = event.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
