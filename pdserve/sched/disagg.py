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
"""

from __future__ import annotations

from collections import deque

from pdserve.cache.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.request import Request, RequestStatus
from pdserve.sched.base import Plan
from pdserve.sched.multiplex import MultiplexScheduler, fcfs_chunks


def split_pool(num_blocks: int, prefill_fraction: float) -> tuple[int, int]:
    """(prefill pages, decode pages); each pool keeps at least one page."""
    if not 0.0 < prefill_fraction < 1.0:
        raise ValueError(f"disagg_prefill_kv_fraction must be in (0, 1), not {prefill_fraction}")
    if num_blocks < 2:
        raise ValueError("disaggregation needs a KV pool of at least two pages")
    prefill = min(num_blocks - 1, max(1, round(num_blocks * prefill_fraction)))
    return prefill, num_blocks - prefill


class DisaggScheduler:
    """Two sides over two pools; the engine loop (``engine/disagg.py``) drives it."""

    name = "disagg"

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        num_prefill, num_decode = split_pool(block_manager.num_blocks,
                                             config.disagg_prefill_kv_fraction)
        size = block_manager.block_size
        self.config = config
        self.max_model_len = max_model_len
        self.prefill = MultiplexScheduler(
            config, BlockManager(num_prefill, size, block_manager.enable_prefix_caching),
            max_model_len)
        self.decode = MultiplexScheduler(config, BlockManager(num_decode, size, False),
                                         max_model_len)
        self.ready: deque[Request] = deque()

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
        return plan

    def check_integrity(self) -> None:
        self.prefill.blocks.check_integrity(
            list(self.prefill.running) + list(self.prefill.waiting) + list(self.ready))
        self.decode.blocks.check_integrity(list(self.decode.running))


def _finish(request: Request, blocks: BlockManager, reason: str) -> None:
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    blocks.free(request)
