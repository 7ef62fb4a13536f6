"""One log line of the engine's state every ``--log-stats-interval-s`` while it works (as
vLLM's engine logs them): prompt and generation throughput over the interval, running and
waiting requests, KV cache use, the prefix cache's hit rate and preemptions; nothing while
it stays idle. ``--disable-log-stats`` turns the line off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.messages import EngineStats

logger = logging.getLogger("pdserve.stats")


@dataclass(frozen=True)
class _Mark:
    at: float
    prompt_tokens: int
    generation_tokens: int
    cache_queries: int
    cache_hits: int
    preemptions: int

    @classmethod
    def of(cls, stats: EngineStats, at: float) -> _Mark:
        return cls(at, stats.prompt_tokens_total, stats.generation_tokens_total,
                   stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)


class StatsLine:
    """The line for the interval since the previous one; None where the engine was idle
    through it and the previous line already said so."""

    def __init__(self, stats: EngineStats, now: float) -> None:
        self._last = _Mark.of(stats, now)
        self._idle_said = True  # nothing to say before the first request

    def next(self, stats: EngineStats, now: float) -> str | None:
        mark, last = _Mark.of(stats, now), self._last
        if mark.prompt_tokens < last.prompt_tokens:  # a restarted engine counts from zero
            last = _Mark(last.at, 0, 0, 0, 0, 0)
        self._last = mark
        idle = (mark.prompt_tokens == last.prompt_tokens
                and mark.generation_tokens == last.generation_tokens
                and stats.num_running == 0 and stats.num_waiting == 0)
        if idle and self._idle_said:
            return None
        self._idle_said = idle
        seconds = max(mark.at - last.at, 1e-9)
        queries = mark.cache_queries - last.cache_queries
        hit_rate = (mark.cache_hits - last.cache_hits) / queries if queries else 0.0
        text = (f"engine: prompt {(mark.prompt_tokens - last.prompt_tokens) / seconds:.1f} "
                f"tokens/s, generation "
                f"{(mark.generation_tokens - last.generation_tokens) / seconds:.1f} tokens/s; "
                f"running {stats.num_running}, waiting {stats.num_waiting} requests; "
                f"KV cache {100 * stats.kv_usage:.1f}% used; prefix cache hit rate "
                f"{100 * hit_rate:.1f}%")
        if mark.preemptions > last.preemptions:
            text += f"; {mark.preemptions - last.preemptions} preempted"
        return text


async def log_stats(stats: Callable[[], EngineStats], interval_s: float,
                    clock: Callable[[], float]) -> None:
    """Logs ``StatsLine``'s line every ``interval_s`` until cancelled."""
    line = StatsLine(stats(), clock())
    while True:
        await asyncio.sleep(interval_s)
        text = line.next(stats(), clock())
        if text is not None:
            logger.info("%s", text)
