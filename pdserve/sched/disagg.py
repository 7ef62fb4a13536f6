"""Request bookkeeping for PD-disaggregation on one engine: two pools, two sides.

A request moves prefill side -> hand-off queue -> decode side, each side with its own KV
pool and block manager (``MultiplexScheduler`` instances, so launches in flight are guarded
the same way: never preempted, aborts deferred until the launch completes).

- Prefill side: waiting queue plus partly prefilled requests, in the prefill pool, where
  the prefix cache lives. A batch takes whole prompts or bounded chunks, FCFS, up to
  ``max_num_batched_tokens``.
- Hand-off (``ready``): prefilled requests (first token sampled) still holding their
  prefill pages, waiting for room in the decode pool. They leave in FCFS order when the
  decode pool can hold their whole context; until then prefill stalls rather than crash.
- Decode side: decode-only steps in the decode pool (no prefix cache there). Running out
  of pages preempts the newest decode request, which goes back to the *front of the
  prefill queue* and is recomputed there (its prompt pages are likely prefix hits).

A request's ``block_ids`` always name pages of the pool it is in at the moment.

Lanes: ``prefill`` (a batch, all layers in one launch, on the prefill partition) and
``decode`` (decode steps on the decode partition); the split is fixed. The hand-off is a
``KVMove`` the engine's KV connector copies before the next launches. Under overlap
scheduling a decode step follows the one in flight on the decode stream before it completes
(its tokens as placeholders); requests handed off meanwhile join it, their KV scattered on
that stream first. Ended requests keep their decode pages until no launch uses them
(``InFlightScheduler``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

from pdserve.cache.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.gpu.partitions import Partition
from pdserve.request import Request, RequestStatus
from pdserve.sched.base import (
    KVMove,
    LaneLaunches,
    OverlapCounters,
    Plan,
    Scheduler,
    StepOutput,
    Work,
)
from pdserve.sched.in_flight import InFlightScheduler, fcfs_chunks

DECODE_LANE, PREFILL_LANE = "decode", "prefill"
TIMELINE_LENGTH = 20_000


@dataclass(frozen=True)
class DisaggTimelineEntry:
    """One launching step: the fixed split, what launched, hand-offs since start."""

    time: float
    mode: str
    decode_sms: int
    prefill_sms: int
    decode_batch: int
    prefill_tokens: int
    kv_transfers: int


def split_pool(num_blocks: int, prefill_fraction: float) -> tuple[int, int]:
    """(prefill pages, decode pages); each pool keeps at least one page."""
    if not 0.0 < prefill_fraction < 1.0:
        raise ValueError(f"disagg_prefill_kv_fraction must be in (0, 1), not {prefill_fraction}")
    if num_blocks < 2:
        raise ValueError("disaggregation needs a KV pool of at least two pages")
    prefill = min(num_blocks - 1, max(1, round(num_blocks * prefill_fraction)))
    return prefill, num_blocks - prefill


class DisaggScheduler(Scheduler):
    """Two sides over two pools, on one fixed SM split."""

    name = "disagg"
    lanes = (DECODE_LANE, PREFILL_LANE)
    waits_for_launches = False
    serves_pd_roles = False  # its decode side already takes KV from its own prefill side
    decode_pool = DECODE_LANE

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 *, partition: Partition):
        # Not Scheduler.__init__: its queues are the two sides' (see the properties below).
        self.config, self.blocks, self.max_model_len = config, block_manager, max_model_len
        self.last_work: Work | None = None
        self.overlap = OverlapCounters(config.overlap_schedule)
        self.partition = partition
        num_prefill, num_decode = split_pool(block_manager.num_blocks,
                                             config.disagg_prefill_kv_fraction)
        size = block_manager.block_size
        self.prefill = InFlightScheduler(
            config, BlockManager(num_prefill, size, block_manager.enable_prefix_caching),
            max_model_len)
        self.decode = InFlightScheduler(config, BlockManager(num_decode, size, False),
                                        max_model_len)
        self.prefill.overlap = self.decode.overlap = self.overlap  # one count for describe()
        self.prefill_order = self.prefill.prefill_order  # prompts wait on the prefill side
        self.ready: deque[Request] = deque()
        self.decodes = LaneLaunches()  # the decode lane's
        self.prefill_work: Work | None = None
        self.num_transfers = 0
        self._timeline: deque[DisaggTimelineEntry] = deque(maxlen=TIMELINE_LENGTH)

    def pools(self) -> dict[str, BlockManager]:
        return {PREFILL_LANE: self.prefill.blocks, DECODE_LANE: self.decode.blocks}

    def pool_layout(self) -> dict[str, tuple[int, int]]:
        """(first page, pages) of each pool in the engine's KV tensor."""
        num_prefill = self.prefill.blocks.num_blocks
        return {PREFILL_LANE: (0, num_prefill),
                DECODE_LANE: (num_prefill, self.decode.blocks.num_blocks)}

    def live_requests(self, pool: str) -> list[Request]:
        if pool == PREFILL_LANE:
            return list(self.prefill.running) + list(self.prefill.waiting) + list(self.ready)
        return self.decode.live_requests(pool)

    def describe(self) -> dict:
        part = self.partition
        return {"partitions": {"kind": "emulated" if part.emulated else "green contexts",
                               "splits": [(part.decode_sms, part.prefill_sms)]}}

    def graph_partitions(self) -> list[Partition]:
        return [self.partition]

    # ---- lanes ----

    @property
    def decode_work(self) -> Work | None:
        """The newest decode step in flight, if any."""
        return self.decodes.newest

    @property
    def retiring(self) -> list[Request]:
        return self.decode.retiring

    def overlap_lanes(self) -> dict[str, str]:
        return {DECODE_LANE: "decode steps: the next one follows on the decode stream",
                PREFILL_LANE: "not overlapped: a prefill batch's requests go to the hand-off "
                              "queue only once it completed"}

    def schedule(self, idle_lanes=(DECODE_LANE, PREFILL_LANE)) -> dict[str, Work]:
        works = {}
        if DECODE_LANE in idle_lanes:  # nothing in flight there, or one overlapped step
            self._schedule_decode(works)
        if self.prefill_work is None:
            self.prefill.order_waiting()
            plan = self.plan_prefill()
            if not plan.is_empty():
                self.prefill.launched(plan)
                # A dedicated partition has nobody to re-plan for: all layers in one launch.
                works[PREFILL_LANE] = self.prefill_work = Work(
                    plan, self.partition, "prefill", pool=PREFILL_LANE)
        if works:
            self.last_work = next(iter(works.values()))
            self._note()
        return works

    def _schedule_decode(self, works: dict[str, Work]) -> None:
        plan = self.plan_decode()
        if not plan.decodes:
            return
        overlapped = self.overlap.allows(plan)
        self.decode.launched(plan, overlapped)
        works[DECODE_LANE] = Work(plan, self.partition, pool=DECODE_LANE, overlapped=overlapped)
        self.decodes.add(works[DECODE_LANE])

    def issued(self, work: Work) -> None:
        if work.side == "decode":
            self.decode.issued(work)

    def _note(self) -> None:
        part = self.partition
        decode = len(self.decode_work.plan.decodes) if self.decode_work else 0
        prefill = self.prefill_work.plan.num_tokens if self.prefill_work else 0
        self._timeline.append(DisaggTimelineEntry(
            time.monotonic(), "disagg", part.decode_sms, part.prefill_sms, decode, prefill,
            self.num_transfers))

    def timeline(self, since: float | None = None) -> list[dict]:
        return [asdict(e) for e in self._timeline if since is None or e.time >= since]

    def update_work(self, work: Work, output: StepOutput) -> list[Request]:
        if self.decodes.pop_if_oldest(work):
            return self.decode.complete(work.plan, output, work.overlapped)
        self.prefill_work = None
        ended = self.prefill.complete(work.plan, output)
        self.take_prefilled()
        return ended

    def fail(self, work: Work) -> list[Request]:
        if self.decodes.discard(work):
            return self.decode.fail(work)
        self.prefill_work = None
        return self.prefill.fail(work)

    def take_moves(self) -> list[KVMove]:
        moves = []
        while (request := self.next_handoff()) is not None:
            source, target = self.move_to_decode(request)
            self.num_transfers += 1
            moves.append(KVMove(request, PREFILL_LANE, source, DECODE_LANE, target,
                                request.num_computed, self.partition))
        return moves

    def fill_stats(self, stats) -> None:
        super().fill_stats(stats)
        stats.mux_mode = "disagg"
        stats.decode_sms, stats.prefill_sms = (self.partition.decode_sms,
                                               self.partition.prefill_sms)

    # ------------------------------------------------------------ engine API

    @property
    def waiting(self) -> deque[Request]:
        return self.prefill.waiting


    @property
    def running(self) -> list[Request]:
        return self.prefill.running + list(self.ready) + self.decode.running


    @property
    def num_preemptions(self) -> int:
        return self.prefill.num_preemptions + self.decode.num_preemptions


    def add(self, request: Request) -> None:
        self.prefill.add(request)

    def has_work(self) -> bool:
        return self.prefill.has_work() or bool(self.ready) or self.decode.has_work()

    def fits(self, num_tokens: int) -> str | None:
        """Why a request of ``num_tokens`` (prompt + max output) can never run, or None.
        Both pools must hold it: a preempted request is recomputed in the prefill pool."""
        for side, sched in (("prefill", self.prefill), ("decode", self.decode)):
            needed = sched.blocks.blocks_needed(num_tokens)
            if needed > sched.blocks.num_blocks:
                return (f"the request needs {needed} KV blocks; the {side} pool has "
                        f"{sched.blocks.num_blocks}")
        return None

    def abort(self, request_id: str) -> Request | None:
        """Aborts now, or once the launch using the request completes (None then)."""
        for request in self.ready:
            if request.request_id == request_id:
                self.ready.remove(request)
                _finish(request, self.prefill.blocks, "abort")
                return request
        for side in (self.prefill, self.decode):
            if request_id in side.in_flight:
                side.pending_aborts.add(request_id)
                return None
            request = side.abort(request_id)
            if request is not None:
                return request
        return None

    # ---------------------------------------------------------- prefill side

    def plan_prefill(self) -> Plan:
        """A new prefill batch, FCFS, at most ``max_num_batched_tokens`` tokens."""
        candidates = self.prefill.prefill_candidates()
        chunks = fcfs_chunks(candidates, self.config.max_num_batched_tokens)
        plan = self.prefill.plan_prefill(candidates, chunks)
        if plan.is_empty() and not self.ready:
            self._unblock_prefill()
        return plan

    def _unblock_prefill(self) -> None:
        # Partly prefilled requests hold pages and never preempt each other, so two of them
        # could wait on each other's pages forever; with nothing left to hand off (which
        # would free pages), the newest one gives its pages back and is recomputed later
        # (its full pages stay in the prefix cache).
        idle = [r for r in self.prefill.running if r.request_id not in self.prefill.in_flight]
        if len(idle) > 1 and not self.prefill.in_flight:
            self.prefill._preempt(idle[-1], Plan())

    def take_prefilled(self) -> list[Request]:
        """Moves requests whose prefill is done (one uncomputed token) to the hand-off queue."""
        done = [r for r in self.prefill.running
                if r.num_uncomputed == 1 and r.request_id not in self.prefill.in_flight]
        for request in done:
            self.prefill.running.remove(request)
            self.ready.append(request)
        return done

    # -------------------------------------------------------------- hand-off

    def next_handoff(self) -> Request | None:
        """The oldest prefilled request, if the decode pool can take its whole context now."""
        if not self.ready or len(self.decode.running) >= self.config.max_num_seqs:
            return None
        request = self.ready[0]
        needed = self.decode.blocks.blocks_needed(request.num_tokens)
        return request if needed <= self.decode.blocks.num_free_blocks else None

    def move_to_decode(self, request: Request) -> tuple[list[int], list[int]]:
        """Gives ``request`` decode pages and releases its prefill pages (they stay in the
        prefix cache). Returns (prefill page ids, decode page ids) for the copy, which the
        caller issues before any later prefill may reuse those pages (same stream)."""
        self.ready.remove(request)
        source = list(request.block_ids)
        self.prefill.blocks.commit(request)
        self.prefill.blocks.free(request)
        if not self.decode.blocks.grow(request, request.num_tokens):
            raise RuntimeError("decode pool shrank between check and hand-off")
        self.decode.running.append(request)
        return source, list(request.block_ids)

    # ----------------------------------------------------------- decode side

    def plan_decode(self) -> Plan:
        """One token per decode request; victims of preemption go back to prefill, first."""
        plan = self.decode.plan_decode()
        if plan.preempted:
            victims = list(self.decode.waiting)
            self.decode.waiting.clear()
            self.prefill.waiting.extendleft(reversed(victims))
            self.prefill_order.dirty = True
        return plan



def _finish(request: Request, blocks: BlockManager, reason: str) -> None:
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    blocks.free(request)
