"""The real server's streaming answers, byte for byte, with a deterministic step grouping.

A real ``EngineCore`` on the tiny model runs inside the test's process and a real aiohttp
server answers over a real socket; only the pipe between them is replaced by direct calls.
The engine steps only once every stream's handler has taken the previous step, so which
tokens share a chunk no longer depends on how busy the host is: the same requests give the
same bytes on every run (ids, ``created`` and wall-clock stamps aside, see ``normalize``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.messages import AbortRequests, AddRequest, StepOutputs
from pdserve.server.app import build_app
from pdserve.server.client import EngineClient
from pdserve.server.config import ServerConfig
from pdserve.testing import free_port

# Values that differ on every run whatever the server does: random ids, the creation
# second, and the server's own monotonic stamps (``return_engine_timing``).
_VOLATILE = [
    (re.compile(rb'"id":"(cmpl|chatcmpl)-[0-9a-f]+"'), rb'"id":"\1-ID"'),
    (re.compile(rb'"created":\d+'), rb'"created":0'),
    (re.compile(rb'"(server_arrival_time|server_first_token_time)":[0-9.e+-]+'),
     rb'"\1":0'),
    (re.compile(rb'"id":"call_[0-9A-Za-z]+"'), rb'"id":"call_ID"'),
]


# Log-probabilities are the model's numbers, not the server's: their last digits follow the
# CPU's float reductions (torch's thread count, the machine). ``split_floats`` takes them out
# so the bytes around them compare exactly and they compare within a tolerance.
_LONG_FLOAT = re.compile(r'-?\d+\.\d{5,}(?:e-?\d+)?')


def normalize(body: bytes) -> bytes:
    for pattern, replacement in _VOLATILE:
        body = pattern.sub(replacement, body)
    return body


def split_floats(body: str) -> tuple[str, list[float]]:
    """``body`` with each long float replaced by ``<f>``, and those floats in order."""
    return _LONG_FLOAT.sub("<f>", body), [float(x) for x in _LONG_FLOAT.findall(body)]


class _InProcessChannel:
    """Stands where ``ServerChannel`` does: messages go to the core at once."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.arrivals: dict[str, float] = {}

    def send(self, message: Any) -> None:
        if isinstance(message, AddRequest):
            self.core.add_request(message.request_id, message.prompt_token_ids,
                                  message.params, arrival_time=0.0)
            self.arrivals[message.request_id] = 0.5
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.core.abort_request(request_id)

    def close(self) -> None:
        pass


class LockstepClient(EngineClient):
    """An ``EngineClient`` whose engine steps on ``drive``: one step per batch, each batch
    handed over once every handler waits for news (``steps_per_batch`` > 1: several steps'
    tokens arrive together, as when the server falls behind)."""

    def __init__(self, core: EngineCore, steps_per_batch: int = 1) -> None:
        super().__init__(None)
        self.core = core
        self.channel = _InProcessChannel(core)
        self.model_name = "tiny"
        self.max_model_len = core.max_model_len
        self.tokenizer = core.tokenizer
        self.vocab_size = core.arch.vocab_size
        self.steps_per_batch = steps_per_batch
        self._clock = itertools.count(1)

    async def drive(self) -> None:
        while True:
            await self._settle()
            batch = [self._step() for _ in range(self.steps_per_batch) if self.core.has_work()]
            if batch:
                self._on_batch(batch)
            await asyncio.sleep(0 if batch else 0.001)

    def _step(self) -> StepOutputs:
        updates = self.core.step()
        for update in updates:
            update.engine_arrival_time = self.channel.arrivals.pop(update.request_id, None)
        return StepOutputs(updates, float(next(self._clock)))

    async def _settle(self) -> None:
        await asyncio.sleep(0)  # deliveries scheduled with call_soon run first
        while self._handing_scheduled or not all(_waiting(stream)
                                                 for stream in self._streams.values()):
            await asyncio.sleep(0.001)


def _waiting(stream) -> bool:
    """The stream's handler has taken everything and waits for more (or writes inline)."""
    return not stream._items and (stream.listener is not None or stream._waiter is not None)


def tiny_core() -> EngineCore:
    return EngineCore(EngineConfig.from_flat(model="tiny", device="cpu", dtype="float32",
                                             num_blocks=256, max_num_seqs=16))


async def stream_bodies(core: EngineCore, requests: list[tuple[str, dict]],
                        steps_per_batch: int = 1,
                        config: ServerConfig | None = None) -> list[bytes]:
    """Each request's raw answer body, normalized; they run one after another."""
    client = LockstepClient(core, steps_per_batch)
    app = build_app(client, config or ServerConfig(), api_keys=())
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    driver = asyncio.create_task(client.drive())
    try:
        async with aiohttp.ClientSession() as session:
            return [await _post(session, f"http://127.0.0.1:{port}{path}", body)
                    for path, body in requests]
    finally:
        driver.cancel()
        await runner.cleanup()


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> bytes:
    async with session.post(url, data=json.dumps(body),
                            headers={"Content-Type": "application/json"}) as response:
        return normalize(await response.read())
