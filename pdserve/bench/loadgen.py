"""Open-loop load: every request is sent at its arrival offset, whatever the server is doing.

A client that waits for responses before sending more (closed loop) hides overload: the
arrival rate silently drops to what the server sustains. Here arrivals follow the clock;
``max_concurrency`` is the only, explicit, way to cap requests in flight.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from pdserve.bench.client import Backend
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.timeline import TimelineSource, poll
from pdserve.bench.workloads import BenchRequest


@dataclass
class LoadResult:
    records: list[RequestRecord]
    t0: float
    """perf_counter() at the start of the run; sample times are relative to it."""
    duration_s: float
    timeline: list[dict] = field(default_factory=list)


async def _send(backend: Backend, request: BenchRequest, record: RequestRecord,
                limit: asyncio.Semaphore | None, bar: tqdm) -> None:
    try:
        if limit is None:
            await backend.generate(request, record)
        else:
            async with limit:
                record.send_time = time.perf_counter()
                await backend.generate(request, record)
    except Exception as exc:  # noqa: BLE001 - one broken request must not end the run
        record.error = f"{type(exc).__name__}: {exc}"
        record.success = False
    finally:
        if record.end_time is None:
            record.end_time = time.perf_counter()
        bar.update(1)


async def run_load(backend: Backend, requests: list[BenchRequest], offsets: list[float],
                   max_concurrency: int | None = None, progress: bool = True,
                   timeline: TimelineSource | None = None, timeline_interval_s: float = 0.1,
                   desc: str = "requests") -> LoadResult:
    """Sends ``requests[i]`` at ``t0 + offsets[i]`` and waits for all of them."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False)
    stop = asyncio.Event()
    t0 = time.perf_counter()
    poller = None
    if timeline is not None:
        poller = asyncio.create_task(poll(timeline, timeline_interval_s, stop, t0))
    records, tasks = [], []
    for request, offset in zip(requests, offsets, strict=True):
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RequestRecord(request.prompt_len, request.output_len, time.perf_counter())
        records.append(record)
        tasks.append(asyncio.create_task(_send(backend, request, record, limit, bar)))
    await asyncio.gather(*tasks)
    duration = max([r.end_time for r in records] + [t0]) - t0
    stop.set()
    samples = await poller if poller is not None else []
    bar.close()
    return LoadResult(records, t0, duration, samples)
