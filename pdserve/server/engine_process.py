"""The engine process: runs ``EngineCore`` steps and talks to the HTTP process only through
the channel. Nothing here tokenizes, detokenizes or touches HTTP, so the loop's only work
between steps is draining a pipe.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pdserve.messages import (
    AbortRequests,
    AddRequest,
    DescribeQuery,
    DescribeReply,
    EngineDead,
    EngineReady,
    QueueFullError,
    RequestMetrics,
    RequestMetricsQuery,
    RequestMetricsReply,
    RequestRejected,
    ResetPrefixCacheQuery,
    ResetPrefixCacheReply,
    Shutdown,
    StepOutputs,
    TimelineQuery,
    TimelineReply,
)
from pdserve.sampling_params import InvalidRequestError
from pdserve.server.channel import CHANNEL_CLOSED, EngineChannels
from pdserve.signals import ignore_group_signals

logger = logging.getLogger(__name__)

DEFAULT_CORE = "pdserve.engine.core:EngineCore"
STATS_INTERVAL_S = 0.2
IDLE_WAIT_S = 1.0


def run_engine_process(config: Any, pipes: list[tuple[Connection, Connection]],
                       core_factory: str = DEFAULT_CORE) -> None:
    """Process entry point. ``pipes``: (reader, writer) of each HTTP process's channel;
    ``core_factory`` is ``module:attr``, called with the config."""
    ignore_group_signals()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    channels = EngineChannels(pipes)
    try:
        core = _load_factory(core_factory)(config)
    except BaseException:  # noqa: BLE001 - whatever broke the load goes back to the server
        channels.broadcast(EngineDead(traceback.format_exc()))
        channels.close()
        raise SystemExit(1) from None
    channels.broadcast(EngineReady(core.model_name, core.max_model_len, os.getpid(),
                                   getattr(core, "tokenizer", None), _vocab_size(core),
                                   getattr(core, "kv_address", None), _describe(core)))
    try:
        code = EngineLoop(core, channels).run()
    finally:
        if hasattr(core, "close"):
            core.close()
    channels.close()
    # Out without the interpreter's teardown: with torch loaded it took 0.5-1 s of every
    # server's stop (measured on a 2-core host), and nothing is owed by now: the core is
    # closed (its tensor-parallel workers stopped), the channels flushed and closed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _vocab_size(core: Any) -> int | None:
    # The server refuses token ids past this bound: an out-of-range id would fail the
    # embedding lookup inside a step and take every running request down with it.
    for owner in (core, getattr(core, "arch", None), getattr(core, "tokenizer", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def _describe(core: Any) -> dict:
    describe = getattr(core, "describe", None)  # test stand-ins have none
    return describe() if describe is not None else {}


def _load_factory(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


class EngineLoop:
    """Steps the core and routes what comes out: each request's deltas, rejection and
    queries' answers go to the channel that sent it; stats snapshots go to every channel."""

    def __init__(self, core: Any, channels: EngineChannels) -> None:
        self.core = core
        self.channels = channels
        self.stopping = False
        self._arrivals: dict[str, float] = {}  # when the engine received it, until a token
        # request id -> the channel that added it; kept only with several channels (with
        # one, every answer goes to it and the step path does no bookkeeping).
        self._routed = len(channels.channels) > 1
        self._owners: dict[str, int] = {}
        self._request_metrics = RequestMetrics()  # summed over the HTTP processes
        self._stats_dirty = False
        self._last_stats = 0.0

    def run(self) -> int:
        """Returns the process exit code."""
        try:
            while not self.stopping:
                self._take_messages(block=not self.core.has_work())
                if not self.stopping and self.core.has_work():
                    self._step()
                self._maybe_send_stats()
        except BaseException:  # noqa: BLE001 - a failed step kills the engine; say why first
            self.channels.broadcast(EngineDead(traceback.format_exc()))
            return 1
        return 0

    def _take_messages(self, block: bool) -> None:
        timeout = 0.0
        if block:
            timeout = STATS_INTERVAL_S if self._stats_dirty else IDLE_WAIT_S
        try:
            messages = self.channels.take(timeout)
        except EOFError:  # every server process is gone: nobody is left to serve
            self.stopping = True
            return
        for index, arrived, message in messages:
            self._handle(index, message, arrived)

    def _handle(self, index: int, message: Any, arrived: float) -> None:
        self._stats_dirty = True
        if isinstance(message, AddRequest):
            self._add(index, message, arrived)
        elif isinstance(message, AbortRequests):
            self._abort(message.request_ids)
        elif isinstance(message, RequestMetrics):
            self._request_metrics.add(message)
        elif message is CHANNEL_CLOSED:
            self._channel_closed(index)
        elif isinstance(message, Shutdown):
            self.stopping = True
        else:
            self._answer(index, message)

    def _answer(self, index: int, query: Any) -> None:
        if isinstance(query, TimelineQuery):
            reply = TimelineReply(query.query_id, self._timeline(query.since))
        elif isinstance(query, DescribeQuery):
            reply = DescribeReply(query.query_id, _describe(self.core))
        elif isinstance(query, ResetPrefixCacheQuery):
            reply = ResetPrefixCacheReply(query.query_id, self._reset_prefix_cache())
        elif isinstance(query, RequestMetricsQuery):
            others = sum(1 for owner in self._owners.values() if owner != index)
            reply = RequestMetricsReply(query.query_id, self._request_metrics, others)
        else:
            logger.error("unknown message from server %d: %r", index, type(query).__name__)
            return
        self.channels.send(index, reply)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._arrivals.pop(request_id, None)
            self._owners.pop(request_id, None)
            self.core.abort_request(request_id)
        self._send_stats(time.monotonic())  # the running set changed

    def _channel_closed(self, index: int) -> None:
        """An HTTP process is gone: its requests have nobody to go to; the others go on."""
        orphans = [rid for rid, owner in self._owners.items() if owner == index]
        if orphans:
            logger.warning("server process %d is gone; aborting its %d request(s)", index,
                           len(orphans))
            self._abort(orphans)

    def _reset_prefix_cache(self) -> dict | None:
        reset = getattr(self.core, "reset_prefix_cache", None)  # test stand-ins keep none
        return reset() if reset is not None else None

    def _timeline(self, since: float | None) -> list[dict]:
        timeline = getattr(self.core, "timeline", None)  # test stand-ins keep none
        return timeline(since) if timeline is not None else []

    def _add(self, index: int, message: AddRequest, arrived: float) -> None:
        # Cores without P/D support (test stand-ins) never see the keyword.
        extra = {"handoff": message.handoff} if message.handoff is not None else {}
        try:
            self.core.add_request(message.request_id, message.prompt_token_ids, message.params,
                                  arrival_time=arrived, **extra)
        except Exception as exc:  # noqa: BLE001 - a bad request must never stop the loop
            status, text = _rejection(exc)
            self.channels.send(index, RequestRejected(message.request_id, status, text))
            return
        self._arrivals[message.request_id] = arrived
        if self._routed:
            self._owners[message.request_id] = index

    def _step(self) -> None:
        self._stats_dirty = True
        updates = self.core.step()
        now = time.monotonic()
        if not updates:
            return
        for update in updates:
            update.engine_arrival_time = self._arrivals.pop(update.request_id, None)
        if any(update.finished for update in updates):
            # The running set changed: the snapshot goes ahead of the tokens that end the
            # requests, so no client sees its answer before /metrics stops counting it.
            self._send_stats(now)
        for index, deltas in self._by_channel(updates).items():
            self.channels.send(index, StepOutputs(deltas, now))

    def _by_channel(self, updates: list) -> dict[int, list]:
        """One frame per channel per step, with only that channel's requests."""
        if not self._routed:
            return {0: updates}
        out: dict[int, list] = {}
        owners = self._owners
        for update in updates:
            owner = owners.pop if update.finished else owners.get
            out.setdefault(owner(update.request_id, 0), []).append(update)
        return out

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if self._stats_dirty and now - self._last_stats >= STATS_INTERVAL_S:
            self._send_stats(now)

    def _send_stats(self, now: float) -> None:
        busy = self.core.has_work()
        snapshot = self.core.stats()
        if not busy:  # the last step's batch sizes would otherwise read as current load
            snapshot.last_batch_decode = snapshot.last_batch_prefill_tokens = 0
        self.channels.broadcast(snapshot)
        self._last_stats = now
        self._stats_dirty = busy


def _rejection(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, InvalidRequestError):
        return 400, str(exc)
    if isinstance(exc, QueueFullError):
        return 429, str(exc) or "the waiting queue is full"
    logger.exception("add_request failed")
    return 500, f"internal error: {type(exc).__name__}: {exc}"
