"""The engine as the HTTP process sees it: start the engine process, submit and abort
requests, receive their token deltas. Reading the channel happens on the event loop (a
reader callback on the pipe), so the server never blocks on the engine.

When the engine process dies, the requests it held fail with a retryable 503 and a new
process is started (``RestartPolicy``); ``alive`` is False until it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pdserve.handoff import KVHandoff
from pdserve.messages import (
    AbortRequests,
    AddRequest,
    DescribeQuery,
    DescribeReply,
    EngineDead,
    EngineReady,
    EngineStats,
    RequestMetrics,
    RequestMetricsQuery,
    RequestMetricsReply,
    RequestRejected,
    RequestUpdate,
    ResetPrefixCacheQuery,
    ResetPrefixCacheReply,
    Shutdown,
    StepOutputs,
    TimelineQuery,
    TimelineReply,
)
from pdserve.sampling_params import SamplingParams
from pdserve.server.channel import ServerChannel
from pdserve.server.engine_process import DEFAULT_CORE, run_engine_process
from pdserve.server.protocol import APIError

logger = logging.getLogger(__name__)


Items = list[tuple[RequestUpdate, float]]
"""A request's deltas, each with the engine time of its step."""

# Streams whose writers run in one event-loop callback. Between two such callbacks the loop
# polls its sockets, so a new request is read and handled after at most this many chunk
# writes instead of after every stream's chunk of the step (64 streams at ~30 us each kept
# new requests waiting ~2 ms per step on the H200 host).
STREAMS_PER_CALLBACK = 16


class RequestStream:
    """Deltas of one request, buffered until its handler runs, or handed straight to a
    ``listener`` (a streaming handler's writer) inside the dispatch of a step.

    A handler that falls behind gets everything that arrived since its last wake-up in one
    ``get()``, so a slow client costs one chunk with several tokens, not a growing backlog.
    """

    __slots__ = ("request_id", "arrival_time", "finished", "listener", "_items", "_error",
                 "_waiter")

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.finished = False  # the engine has let go of the request
        self.listener: Callable[[Items], None] | None = None
        """Takes the deltas inside the dispatch (no task wake-up); it calls ``wake`` when the
        handler has something to do."""
        self._items: Items = []
        self._error: APIError | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, items: Items) -> None:
        """One dispatch's deltas (several steps' worth when the server fell behind)."""
        # A request's finishing delta is its last: ``_collect_step`` lets go of it there.
        self.finished = self.finished or items[-1][0].finished
        if self.listener is not None:
            self.listener(items)
            return
        self._items += items
        self.wake()

    def fail(self, error: APIError) -> None:
        self._error = error
        self.finished = True
        self.wake()

    def wake(self) -> None:
        # A bare future, not an asyncio.Event: this runs for every token of every stream.
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until the next ``put``, ``fail`` or ``wake``; at once if deltas or an error wait."""
        if self._items or self._error is not None:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> Items:
        """What is buffered (maybe nothing); raises the request's ``APIError`` once drained."""
        if self._items:
            items, self._items = self._items, []
            return items
        if self._error is not None:
            raise self._error
        return []

    async def get(self) -> Items:
        """Waits for news; raises the request's ``APIError`` if it was refused or lost."""
        while not self._items and self._error is None:
            await self.wait()
        return self.take()


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead engine process is replaced."""

    attempts: int = 3
    """Restarts in a row before the server gives up (0: never restart)."""
    backoff_s: float = 1.0
    """Wait before the first restart of an outage; each further attempt doubles it."""
    stable_s: float = 60.0
    """An engine that ran this long before dying starts the count of restarts again."""
    off_reason: str = "restarts are off (--engine-restarts 0)"
    """What the give-up message says when ``attempts`` is 0."""

    def delay(self, attempt: int) -> float:
        return self.backoff_s * 2 ** (attempt - 1)


Pipe = tuple[Connection, Connection]
"""The server end of one channel: (reader from the engine, writer to it)."""


class EngineClient:
    """One HTTP process's view of the engine. The process that starts the engine owns it
    (``start``); with ``--api-server-count`` N it also opens N - 1 further channels
    (``worker_pipes``) for the other HTTP processes, which ``attach`` to them."""

    def __init__(self, engine_config: Any, core_factory: str = DEFAULT_CORE,
                 start_timeout: float = 600.0, restart: RestartPolicy | None = None,
                 api_server_count: int = 1) -> None:
        self.engine_config = engine_config
        self.api_server_count = api_server_count
        self.worker_pipes: list[Pipe] = []
        """Server ends of the other HTTP processes' channels, until handed over."""
        self.core_factory = core_factory
        self.start_timeout = start_timeout
        self.restart_policy = restart or RestartPolicy()
        self.process: mp.process.BaseProcess | None = None
        self.channel: ServerChannel | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.tokenizer: Any = None
        self.vocab_size: int | None = None
        self.kv_address: str | None = None
        self.setup: dict = {}
        self.engine_pid = 0
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self.restarts = 0  # engine processes started after the first
        self._streams: dict[str, RequestStream] = {}
        self._queued: dict[RequestStream, Items] = {}
        """Listener streams' deltas not yet handed over, a stream's deltas merged."""
        self._handing: list[tuple[RequestStream, Items]] = []
        """Taken from ``_queued``: handed over a callback's worth at a time, in order."""
        self._handing_scheduled = False
        self.batch_received = 0.0
        """When the channel's latest batch was read (``return_engine_timing`` reports it with
        a request's first token: the engine-to-server part of its delivery)."""
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[EngineReady] = self._loop.create_future()
        self._closing = False
        self._queries: dict[int, asyncio.Future[list[dict]]] = {}
        self._next_query = 0
        self._generation = 0  # which process the channel callbacks belong to
        self._up_since = 0.0
        self._attempts_in_row = 0
        self._restarter: asyncio.Task | None = None
        self.gave_up: asyncio.Future[str] = self._loop.create_future()
        """Resolves with the reason once the engine is dead and no restart is left."""

    @classmethod
    async def start(cls, engine_config: Any, core_factory: str = DEFAULT_CORE,
                    timeout: float = 600.0, restart: RestartPolicy | None = None,
                    api_server_count: int = 1) -> EngineClient:
        """Spawns the engine process and waits until its model is loaded."""
        client = cls(engine_config, core_factory, timeout, restart, api_server_count)
        await client._launch()
        return client

    @classmethod
    async def attach(cls, pipe: Pipe, timeout: float = 600.0) -> EngineClient:
        """The client of an HTTP process that did not start the engine: it talks over
        ``pipe`` (one of the starter's ``worker_pipes``) and never restarts the engine."""
        client = cls(None, start_timeout=timeout, restart=RestartPolicy(
            0, off_reason="only the first HTTP process could restart it"))
        await client._open(*pipe)
        return client

    async def _launch(self) -> None:
        """Starts an engine process on fresh channels; RuntimeError if it does not load."""
        self.process, pipes = _spawn(self.engine_config, self.core_factory,
                                     self.api_server_count)
        self.worker_pipes = pipes[1:]
        await self._open(*pipes[0])

    async def _open(self, reader: Connection, writer: Connection) -> None:
        """Reads ``reader`` until the engine says it is ready; RuntimeError if it does not."""
        self._generation += 1
        self._ready = self._loop.create_future()
        on_batch, on_eof = self._callbacks(self._generation)
        self.channel = await ServerChannel.open(reader, writer, on_batch, on_eof)
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready), self.start_timeout)
        except TimeoutError:
            self._kill()
            raise RuntimeError(f"the engine did not load within {self.start_timeout:.0f} s"
                               ) from None
        self._apply_ready(ready)
        self._up_since = time.monotonic()

    def _callbacks(self, generation: int) -> tuple[Callable[[list[Any]], None],
                                                   Callable[[], None]]:
        """Channel callbacks that go quiet once a later process has replaced this one: a
        dead process's pipe may report its end after the new one is up."""

        def on_batch(batch: list[Any]) -> None:
            if generation == self._generation:
                self._on_batch(batch)

        def on_eof() -> None:
            if generation == self._generation:
                self._on_eof()

        return on_batch, on_eof

    def _apply_ready(self, ready: EngineReady) -> None:
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.tokenizer = ready.tokenizer
        self.vocab_size = ready.vocab_size
        self.kv_address = ready.kv_address
        self.setup = ready.setup
        self.engine_pid = ready.pid

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, handoff: KVHandoff | None = None) -> RequestStream:
        if self.dead_reason is not None:
            raise APIError(503, "the engine is not running")
        stream = RequestStream(request_id, arrival_time)
        self._streams[request_id] = stream
        self.channel.send(AddRequest(request_id, prompt_token_ids, params, arrival_time,
                                     handoff))
        return stream

    def abort(self, request_id: str) -> None:
        """Frees the request in the engine; a no-op once the engine has finished it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and self.dead_reason is None:
            self.channel.send(AbortRequests([request_id]))

    def publish_metrics(self, delta: RequestMetrics) -> None:
        """Adds what this process observed to the engine process's sums (several HTTP
        processes)."""
        if self.dead_reason is None:
            self.channel.send(delta)

    async def request_metrics(self, timeout: float = 30.0) -> RequestMetricsReply:
        """The request metrics summed over every HTTP process."""
        return await self._query(RequestMetricsQuery, timeout)

    def abort_all(self, reason: str) -> None:
        ids = list(self._streams)
        for request_id in ids:
            self._streams.pop(request_id).fail(APIError(503, reason))
        if ids and self.dead_reason is None:
            self.channel.send(AbortRequests(ids))

    async def timeline(self, since: float | None = None, timeout: float = 30.0) -> list[dict]:
        """The engine's timeline (``EngineCore.timeline``): decisions or steps by policy."""
        return await self._query(lambda query_id: TimelineQuery(query_id, since), timeout)

    async def describe(self, timeout: float = 30.0) -> dict:
        """``EngineCore.describe()`` now: the set-up plus counters as of this moment (the
        start-up snapshot, ``setup``, would show counters at zero)."""
        return await self._query(DescribeQuery, timeout)

    async def reset_prefix_cache(self, timeout: float = 30.0) -> dict | None:
        """``EngineCore.reset_prefix_cache()``: the counts, or None where the engine keeps
        no prefix cache to reset."""
        return await self._query(ResetPrefixCacheQuery, timeout)

    async def _query(self, make: Any, timeout: float) -> Any:
        if self.dead_reason is not None:
            raise APIError(503, "the engine is not running")
        self._next_query += 1
        query_id = self._next_query
        future = self._queries[query_id] = self._loop.create_future()
        self.channel.send(make(query_id))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise APIError(503, "the engine did not answer in time") from None
        finally:
            self._queries.pop(query_id, None)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine process and waits for it; kills it if it does not leave in time."""
        self._closing = True
        if self._restarter is not None:
            self._restarter.cancel()
        if self.process is None:  # attached: the process that started the engine stops it
            self.channel.close()
            return
        if self.process.is_alive():
            self.channel.send(Shutdown())
        await self._loop.run_in_executor(None, self.process.join, timeout)
        if self.process.is_alive():
            logger.warning("engine process did not exit in %.0f s; killing it", timeout)
            self.process.kill()
            await self._loop.run_in_executor(None, self.process.join, 5.0)
        self.channel.close()

    # ---- channel -> streams ---------------------------------------------------------------

    def _on_batch(self, batch: list[Any]) -> None:
        """Everything the channel had ready: each stream gets all its deltas at once."""
        self.batch_received = time.monotonic()
        pending: dict[RequestStream, Items] = {}
        for message in batch:
            if isinstance(message, StepOutputs):
                self._collect_step(message, pending)
                continue
            self._deliver(pending)  # deltas stay ahead of a later rejection or failure
            self._dispatch(message)
        self._deliver(pending)

    def _on_eof(self) -> None:
        if not self._ready.done():
            code = self.process.exitcode if self.process is not None else "unknown"
            self._ready.set_exception(RuntimeError(
                f"the engine process exited during start-up (code {code})"))
        elif not self._closing:
            self._on_death("the engine process exited")

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, EngineStats):
            self.stats = message
        elif isinstance(message, TimelineReply | DescribeReply | ResetPrefixCacheReply
                        | RequestMetricsReply):
            future = self._queries.get(message.query_id)
            if future is not None and not future.done():
                future.set_result(_answer(message))
        elif isinstance(message, RequestRejected):
            stream = self._streams.pop(message.request_id, None)
            if stream is not None:
                stream.fail(_rejection_error(message))
        elif isinstance(message, EngineReady):
            self._ready.set_result(message)
        elif isinstance(message, EngineDead):
            self._on_engine_failure(message.message)

    def _on_engine_failure(self, text: str) -> None:
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(f"the engine failed to start:\n{text}"))
            return
        logger.error("engine failed:\n%s", text)
        self._on_death("the engine failed; see the server log")

    def _collect_step(self, message: StepOutputs, pending: dict[RequestStream, Items]) -> None:
        streams = self._streams
        step_time = message.time
        for delta in message.deltas:
            stream = streams.get(delta.request_id)
            if stream is None:
                continue  # aborted here while the step ran
            items = pending.get(stream)
            if items is None:
                pending[stream] = [(delta, step_time)]
            else:
                items.append((delta, step_time))
            if delta.finished:
                del streams[delta.request_id]

    def _deliver(self, pending: dict[RequestStream, Items]) -> None:
        if not pending:
            return
        queued = self._queued
        for stream, items in pending.items():
            if stream.listener is None:
                stream.put(items)
            elif stream in queued:  # still waiting from an earlier batch: one chunk for both
                queued[stream] += items
            else:
                queued[stream] = items
        pending.clear()
        if queued and not self._handing_scheduled:
            # Handlers woken above (first tokens, non-streaming requests) run before the
            # listeners' writes: callbacks run in the order they were scheduled.
            self._handing_scheduled = True
            self._loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:
        """Gives the next few listener streams their deltas; schedules itself again while
        any wait. A stream's deltas queued after it was taken wait for the next round, so
        every stream gets its deltas in order."""
        if not self._handing:
            self._handing = list(self._queued.items())
            self._queued.clear()
        batch = self._handing[:STREAMS_PER_CALLBACK]
        del self._handing[:STREAMS_PER_CALLBACK]
        for stream, items in batch:
            stream.put(items)
        self._handing_scheduled = bool(self._handing or self._queued)
        if self._handing_scheduled:
            self._loop.call_soon(self._hand_over)

    def _on_death(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.abort_all(reason)
        for future in self._queries.values():
            if not future.done():
                future.set_exception(APIError(503, reason))
        self.dead_reason = reason
        self.stats = EngineStats()  # the dead engine's pages and queues are gone with it
        logger.error("%s; /health now answers 503", reason)
        self._restarter = asyncio.ensure_future(self._restart(reason))

    # ---- restarts -------------------------------------------------------------------------

    async def _restart(self, reason: str) -> None:
        """Replaces the dead process, waiting longer after each failed attempt; resolves
        ``gave_up`` once the policy's attempts are spent."""
        await self._reap()
        self.engine_config = self._config_keeping_kv_port()
        policy = self.restart_policy
        if time.monotonic() - self._up_since >= policy.stable_s:
            self._attempts_in_row = 0
        while not self._closing:
            self._attempts_in_row += 1
            attempt = self._attempts_in_row
            if attempt > policy.attempts:
                self._give_up(reason)
                return
            logger.warning("restarting the engine in %.1f s (attempt %d of %d)",
                           policy.delay(attempt), attempt, policy.attempts)
            await asyncio.sleep(policy.delay(attempt))
            try:
                await self._launch()
            except RuntimeError as exc:
                reason = str(exc)
                logger.error("engine restart failed: %s", reason)
                await self._reap()
                continue
            self.restarts += 1
            self.dead_reason = None
            logger.info("engine restarted (pid %d); /health answers 200", self.process.pid)
            return

    def _give_up(self, reason: str) -> None:
        attempts = self.restart_policy.attempts
        tried = (f"it died or failed to load after {attempts} restart(s) in a row" if attempts
                 else self.restart_policy.off_reason)
        if not self.gave_up.done():
            self.gave_up.set_result(f"the engine process is gone ({reason}); {tried}")

    async def _reap(self) -> None:
        """Kills what is left of the current process (a failed step's engine may still be
        leaving, holding its KV port) and closes its channel."""
        process = self.process
        if process is not None:
            self._kill()
            await self._loop.run_in_executor(None, process.join, 10.0)
        self.channel.close()

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def _config_keeping_kv_port(self) -> Any:
        """The engine config for a new process: a KV receiver keeps the port it had, so the
        address a P/D group knows stays right."""
        transfer = getattr(self.engine_config, "transfer", None)
        if self.kv_address is None or transfer is None:
            return self.engine_config
        port = int(self.kv_address.rpartition(":")[2])
        return dataclasses.replace(self.engine_config, transfer=dataclasses.replace(
            transfer, kv_transfer_port=port))


def _answer(reply: TimelineReply | DescribeReply | ResetPrefixCacheReply
            | RequestMetricsReply) -> Any:
    if isinstance(reply, TimelineReply):
        return reply.entries
    if isinstance(reply, ResetPrefixCacheReply):
        return reply.counts
    return reply.info if isinstance(reply, DescribeReply) else reply


def _rejection_error(message: RequestRejected) -> APIError:
    if message.status == 429:
        return APIError(429, message.message, code="queue_full")
    return APIError(message.status, message.message)


def channel_pipes(count: int) -> tuple[list[Pipe], list[Pipe]]:
    """``count`` channels' pipes: the engine's ends (reader from the server, writer to it)
    and the servers' ends (reader from the engine, writer to it)."""
    engine_ends, server_ends = [], []
    for _ in range(count):
        to_engine_r, to_engine_w = mp.Pipe(duplex=False)
        from_engine_r, from_engine_w = mp.Pipe(duplex=False)
        engine_ends.append((to_engine_r, from_engine_w))
        server_ends.append((from_engine_r, to_engine_w))
    return engine_ends, server_ends


def _spawn(engine_config: Any, core_factory: str, channels: int = 1
           ) -> tuple[mp.process.BaseProcess, list[Pipe]]:
    """The engine process, and the server end of each of its ``channels``."""
    # spawn, not fork: the engine initialises CUDA, which does not survive a fork.
    ctx = mp.get_context("spawn")
    engine_ends, server_ends = channel_pipes(channels)
    process = ctx.Process(target=run_engine_process, name="pdserve-engine", daemon=True,
                          args=(engine_config, engine_ends, core_factory))
    process.start()
    # Our copies of the engine's ends must go, or its death would never read as EOF here.
    for reader, writer in engine_ends:
        reader.close()
        writer.close()
    return process, server_ends
