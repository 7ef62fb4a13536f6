"""In-process backend: drives an ``EngineCore`` from its own thread, no HTTP in the way.

The engine loop runs on a worker thread (``step()`` blocks for a whole forward pass);
the asyncio side only submits requests and awaits futures. Token times are taken the
moment ``step()`` returns, which is when a streaming server could first send them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workloads import BenchRequest

IDLE_WAIT_S = 0.005


def build_engine(model: str, engine_args: dict[str, Any]) -> Any:
    """An ``EngineCore`` for ``model`` (imported lazily: the bench must load without torch)."""
    from pdserve.config import EngineConfig
    from pdserve.engine.core import EngineCore

    return EngineCore(EngineConfig.from_flat(model=model, **engine_args))


class _Pending:
    def __init__(self, request: BenchRequest, record: RequestRecord,
                 future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.record = record
        self.future = future
        self.loop = loop

    def resolve(self) -> None:
        self.loop.call_soon_threadsafe(_set_done, self.future)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class EngineBackend:
    """Runs requests on an engine made by ``engine_factory`` (called on start)."""

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        self.engine_factory = engine_factory
        self.engine: Any = None
        self.timeline: list[dict] = []
        self._inbox: queue.Queue[_Pending] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._dead = ""

    async def start(self) -> None:
        self.engine = await asyncio.to_thread(self.engine_factory)
        self._thread = threading.Thread(target=self._loop, name="bench-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def generate(self, request: BenchRequest, record: RequestRecord) -> None:
        if self._dead:
            record.error = self._dead
            record.end_time = time.perf_counter()
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Pending(request, record, future, loop))
        await future

    # --- worker thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit()
            if not self.engine.has_work():
                self._wait_for_request()
                continue
            try:
                updates = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a crash must fail requests, not hang
                self._fail_all(f"engine step failed: {exc!r}")
                return
            self._deliver(updates, time.perf_counter())

    def _wait_for_request(self) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            return
        self._add(item)

    def _admit(self) -> None:
        while True:
            try:
                self._add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _add(self, item: _Pending) -> None:
        from pdserve.sampling_params import SamplingParams

        request_id = f"bench-{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=item.request.output_len, temperature=0.0,
                                ignore_eos=True)
        try:
            self.engine.add_request(request_id, item.request.prompt_token_ids, params)
        except Exception as exc:  # noqa: BLE001 - a refused request is a failed sample
            item.record.error = f"add_request failed: {exc!r}"
            item.record.end_time = time.perf_counter()
            item.resolve()
            return
        self._pending[request_id] = item

    def _deliver(self, updates: list, now: float) -> None:
        tokens = 0
        for update in updates:
            item = self._pending.get(update.request_id)
            if item is None:
                continue
            new = len(update.new_token_ids or [])
            tokens += new
            if new:
                item.record.add_chunk(now, new, "engine")
            if update.finished:
                self._finish(update.request_id, item, now)
        self.timeline.append({"t": now, "batch_requests": len(updates), "batch_tokens": tokens,
                              "running": len(self._pending)})

    def _finish(self, request_id: str, item: _Pending, now: float) -> None:
        del self._pending[request_id]
        item.record.end_time = now
        item.record.success = item.record.num_output_tokens > 0
        item.resolve()

    def _fail_all(self, message: str) -> None:
        self._dead = message
        self._admit()
        now = time.perf_counter()
        for item in self._pending.values():
            item.record.error = message
            item.record.end_time = now
            item.resolve()
        self._pending.clear()
