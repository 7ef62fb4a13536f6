"""Bookkeeping for policies whose launches complete after ``schedule`` returns (multiplex,
disagg): which requests decode, which prefill, which are in flight.

- A request in flight is never preempted and never freed: its KV blocks are being read and
  written by kernels the host has not seen finish. Preemption picks the newest running
  request that is *not* in flight; an abort of an in-flight request is deferred until its
  launch completes ("finish it, then drop").
- A request joins decode only when its last prefill chunk has completed (``update_work``),
  so a decode step never reads KV a prefill is still writing.
- Overlap scheduling (decode lanes): a decode or mixed launch marked ``overlapped``
  advances its requests' counters when issued, so they are ready to decode (or take their
  next prompt chunk) again while it runs and the next launch follows it on the same
  stream. They are still in flight: never preempted, never freed, never offered to the
  prefill lane. One that ends meanwhile (a stop found one step late, an abort) is finished
  at once, so nothing more is emitted, but it keeps its pages (``draining``) until the
  last launch using it completes: the lanes run on several streams, and a page freed under
  a running decode could be handed to a prefill on another stream that writes it first.
  For the same reason the prefix cache takes a block only once its KV is written
  (``commit`` counts no token still in flight: ``overlapped`` counts each request's tokens
  that launches still running compute).

Requests are still tracked by token counters: a running request with one uncomputed token
decodes; one with more prefills; a prefix hit that leaves one token is simply a decode.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from pdserve.request import Request, RequestStatus
from pdserve.sched.base import Plan, ScheduledRequest, Scheduler, StepOutput
from pdserve.sched.mux_planner import (
    DecodeLoad,
    InFlightPrefill,
    MuxPlannerConfig,
    PrefillRequest,
    banked_slack_ms,
)

MAX_PLANNED_WAITING = 64  # waiting requests shown to the planner per step: bounds host work


class InFlightScheduler(Scheduler):
    waits_for_launches = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Request ids used by a launch not yet completed whose counters advance when it does.
        self.in_flight: set[str] = set()
        # Tokens whose KV overlapped launches still running write, by request id.
        self.overlapped: Counter[str] = Counter()
        self.pending_aborts: set[str] = set()
        self.draining: list[Request] = []  # ended, holding pages until their launches end

    def busy(self, request: Request) -> bool:
        """A launch still running uses its pages."""
        request_id = request.request_id
        return request_id in self.in_flight or request_id in self.overlapped

    # ---------------------------------------------------------------- views

    def decode_ready(self) -> list[Request]:
        return [r for r in self.running
                if r.num_uncomputed == 1 and r.request_id not in self.in_flight]

    def decode_load(self) -> DecodeLoad | None:
        return decode_load_over(self.decode_ready())

    def prefill_candidates(self, same_stream: bool = False) -> list[Request]:
        """Part-prefilled running requests first (they hold blocks), then the waiting queue.

        ``same_stream``: for a step issued behind an overlapped one on its stream, which may
        take the next chunk of a prompt that one is computing (stream order keeps them apart).
        """
        partial = [r for r in self.running if r.num_uncomputed > 1 and (
            r.request_id not in self.in_flight if same_stream else not self.busy(r))]
        room = max(0, self.config.max_num_seqs - len(self.running))
        waiting = list(self.waiting)[: min(room, MAX_PLANNED_WAITING)]
        return partial + waiting

    @staticmethod
    def planner_view(candidates: Sequence[Request], now: float | None = None
                     ) -> list[PrefillRequest]:
        now = time.monotonic() if now is None else now
        return [PrefillRequest(r.num_uncomputed, r.num_computed,
                               max(0.0, (now - r.arrival_time) * 1e3)) for r in candidates]

    @staticmethod
    def in_flight_view(plan: Plan, layers_done: int) -> InFlightPrefill:
        items = plan.prefills
        return InFlightPrefill(sum(s.num_new_tokens for s in items),
                               sum(s.request.num_computed for s in items), len(items), layers_done)

    # ---------------------------------------------------------------- plans

    def plan_decode(self, max_batch: int | None = None) -> Plan:
        """One token for every decode-ready request (oldest first, up to ``max_batch``)."""
        plan = Plan()
        for request in self.decode_ready()[:max_batch]:
            # Preempted to make room for an older one (see PrefillFirstScheduler._schedule_decodes).
            if request in plan.preempted:
                continue
            if self._grow_or_preempt(request, request.num_tokens, plan):
                plan.decodes.append(ScheduledRequest(request, 1))
        return plan

    def plan_prefill(self, candidates: Sequence[Request], chunks: Sequence[tuple[int, int]],
                     plan: Plan | None = None) -> Plan:
        """Takes the planner's chunks ((index into ``candidates``, tokens), FCFS order).

        Every item lands in ``plan.prefills``, even a one-token chunk: the batch runs
        through the extend path, never the decode graphs. Waiting requests are admitted
        here (prefix hits may shrink their chunk); a chunk that cannot get blocks ends the
        batch, since a prefill never preempts anyone.
        """
        plan = plan if plan is not None else Plan()
        for index, tokens in chunks:
            request = candidates[index]
            if request.request_id in self.running_ids():
                if not self.blocks.grow(request, request.num_computed + tokens):
                    break
                plan.prefills.append(ScheduledRequest(request, tokens))
                continue
            if not self.waiting or self.waiting[0] is not request:
                break  # preempted or aborted since the candidates were listed
            admitted = self._try_admit(tokens)
            if admitted is None:
                break
            plan.prefills.append(ScheduledRequest(*admitted))
        return plan

    def plan_mixed(self, candidates: Sequence[Request], chunks: Sequence[tuple[int, int]]
                   ) -> Plan:
        """A whole-GPU step: every decode plus the prefill chunks (the TEMPORAL mode)."""
        plan = self.plan_decode()
        if plan.preempted:
            return plan  # candidates may have moved; take prefill work next step
        return self.plan_prefill(candidates, chunks, plan)

    def running_ids(self) -> set[str]:
        return {r.request_id for r in self.running}

    # ------------------------------------------------------- launch lifecycle

    def launched(self, plan: Plan, overlapped: bool = False) -> None:
        if overlapped:
            self.overlapped.update({s.request.request_id: s.num_new_tokens
                                    for s in plan.scheduled})
        else:
            self.in_flight.update(s.request.request_id for s in plan.scheduled)

    def complete(self, plan: Plan, output: StepOutput, overlapped: bool = False
                 ) -> list[Request]:
        """Applies a finished launch; returns the requests that finished or were aborted."""
        self._landed(plan, overlapped)
        ended = self.update(plan, output, advanced=overlapped)
        for item in plan.scheduled:
            request_id = item.request.request_id
            if request_id in self.pending_aborts and request_id not in self.in_flight:
                self.pending_aborts.discard(request_id)
                request = self.abort(request_id)
                if request is not None:
                    ended.append(request)
        self._release_drained()
        return ended

    def _landed(self, plan: Plan, overlapped: bool) -> None:
        for item in plan.scheduled:
            request_id = item.request.request_id
            if not overlapped:
                self.in_flight.discard(request_id)
            elif self.overlapped[request_id] > item.num_new_tokens:
                self.overlapped[request_id] -= item.num_new_tokens
            else:
                del self.overlapped[request_id]

    def _release_drained(self) -> None:
        if not self.draining:
            return
        done = [r for r in self.draining if not self.busy(r)]
        for request in done:
            self.draining.remove(request)
            self.blocks.free(request)

    def _finish(self, request: Request, reason: str) -> None:
        if not self.busy(request):
            return super()._finish(request, reason)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.draining.append(request)

    def _committer(self):
        return self._commit_written if self.overlapped else self.blocks.commit

    def _commit_written(self, request: Request) -> None:
        # Tokens an overlapped launch still running computes (one per decode, a prompt
        # chunk's in a mixed step) have no KV written yet: not in the cache.
        owed = self.overlapped.get(request.request_id, 0)
        self.blocks.commit(request, request.num_computed - owed)

    def drop_if_aborted(self, plan: Plan) -> list[Request] | None:
        """Between two pieces of a prefill batch: if every request in it was aborted, the
        rest of its layers are pointless; release and abort them all (None otherwise)."""
        ids = [s.request.request_id for s in plan.scheduled]
        if not all(i in self.pending_aborts for i in ids):
            return None
        aborted = []
        for request_id in ids:
            self.in_flight.discard(request_id)
            self.pending_aborts.discard(request_id)
            request = self.abort(request_id)
            if request is not None:
                aborted.append(request)
        return aborted

    def fail(self, work) -> list[Request]:
        self._landed(work.plan, work.overlapped)
        for item in work.plan.scheduled:
            self.pending_aborts.discard(item.request.request_id)
        failed = super().fail(work)
        self._release_drained()
        return failed

    def abort(self, request_id: str) -> Request | None:
        """Aborts now, or (in a launch whose counters advance when it completes) once that
        launch completes; None when deferred. A request only in overlapped launches ends at
        once and keeps its pages until they complete (``draining``)."""
        if request_id in self.in_flight:
            self.pending_aborts.add(request_id)
            return None
        return super().abort(request_id)

    def live_requests(self, pool: str) -> list[Request]:
        return super().live_requests(pool) + self.draining

    def has_work(self) -> bool:
        return super().has_work() or bool(self.in_flight or self.overlapped or self.draining)

    def _grow_or_preempt(self, request: Request, num_tokens: int, plan: Plan) -> bool:
        """Like the base rule, but victims are only requests no launch is using.

        Returns False when ``request`` was preempted or no victim was left (it waits).
        """
        while not self.blocks.grow(request, num_tokens):
            victim = next((r for r in reversed(self.running) if not self.busy(r)), None)
            if victim is None:
                return False
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True


def fcfs_chunks(candidates, budget: int) -> list[tuple[int, int]]:
    """(candidate index, tokens) in arrival order until ``budget`` tokens are taken."""
    chunks = []
    for index, request in enumerate(candidates):
        if budget <= 0:
            break
        take = min(request.num_uncomputed, budget)
        chunks.append((index, take))
        budget -= take
    return chunks


def decode_load_over(requests: list[Request]) -> DecodeLoad | None:
    """The decode load of these requests (None: no request)."""
    if not requests:
        return None
    return DecodeLoad(len(requests), sum(r.num_tokens for r in requests))


def decode_load_banked(requests: list, config: MuxPlannerConfig, now: float
                       ) -> DecodeLoad | None:
    """``decode_load_over`` with what the requests banked against their TPOT
    (``banked_slack_ms``) where ``config`` spends it."""
    load = decode_load_over(requests)
    if load is None or config.tpot_bank_cap <= 0:
        return load
    return replace(load, slack_ms=banked_slack_ms(requests, config.budget_ms, now,
                                                  config.tpot_bank_quantile))
