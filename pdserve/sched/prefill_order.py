"""The order waiting prompts are admitted in: first come, first served, SLO-aware, or by
each request's priority.

``slo`` (``--prefill-order slo``) maximises the number of prompts whose first token comes
within the TTFT SLO on this one server: Moore-Hodgson's rule. Prompts are taken in deadline
order (arrival + ``--ttft-slo-ms``; with one SLO for all this is arrival order), and whenever
the prompt just taken would finish its prefill past its deadline, the longest prompt taken so
far moves to the back. A prompt that cannot make its deadline anyway (alone, served next) is
served after every prompt that still can: never dropped, and it runs as soon as nothing
meetable waits.

A prompt's service time is its uncomputed tokens over the prefill rate the engine's own
launches delivered (``PrefillRate``), so the order needs no fitted predictor and works under
every policy. Until a first launch with prompt tokens completed there is no rate: the order
stays first come, first served.

With ``--prefill-order-max-wait-ms`` a prompt that has waited that long goes ahead of every
prompt that has not (the overdue in arrival order, the rest ranked after them): the order
then bounds the wait of the prompts it puts last, at the cost of meetable prompts behind
them.

``priority`` (``--prefill-order priority``, vLLM's priority scheduling) admits the waiting
prompt of lowest ``SamplingParams.priority`` first, arrival order among equals. It orders
admission only: a running request is never preempted for one of higher priority.

What the reorder never touches: requests already running (their partial prefill is served
first, by every policy, and counts as backlog ahead of the queue), and preempted requests
that had already produced a token (their TTFT is past; they keep the front of the queue, as
under FCFS, where preemption puts them).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

from pdserve.config import check_prefill_order

if TYPE_CHECKING:
    from pdserve.request import Request

T = TypeVar("T")


class PrefillRate:
    """Prompt tokens per second of launch time, an exponential moving average.

    One sample per completed launch (or per prefill batch, for batches run as layer pieces:
    their pieces' times add up): its prompt tokens over its host-observed time, decodes in the
    same launch included. That is the rate prompts actually advanced at under the running
    policy (a mixed step shares its time with decodes, a spatial piece runs on fewer SMs),
    which is what a deadline estimate needs, rather than the GPU's best prefill speed.
    Launches of a single token (decodes) say nothing about prefill and are not samples.

    Weight 0.2 per sample: a new rate counts within ~5 launches (prompt lengths on a
    conversation trace swing the per-token rate by tens of percent between launches, so a
    single sample should not set it), while a load change still shows within a second.
    Linear in tokens on purpose: attention's quadratic share is averaged into the measured
    rate, which is biased low for short prompts and high for the longest, but keeps the
    order free of a per-model fit."""

    WEIGHT = 0.2

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None
        self.samples = 0
        self._pending_ms = 0.0  # pieces of a batch still running through its layers

    def observe(self, prompt_tokens: int, elapsed_ms: float | None, piece: bool = False,
                final: bool = True) -> None:
        """``piece``: a layer range of a prefill batch; ``final``: its last one."""
        if elapsed_ms is None or elapsed_ms <= 0.0:
            return
        if piece:
            self._pending_ms += elapsed_ms
            if not final:
                return
            elapsed_ms, self._pending_ms = self._pending_ms, 0.0
        if prompt_tokens <= 0:
            return
        sample = prompt_tokens / (elapsed_ms / 1e3)
        rate = self.tokens_per_s
        self.tokens_per_s = sample if rate is None else rate + self.WEIGHT * (sample - rate)
        self.samples += 1

    def seconds(self, tokens: int) -> float:
        """Predicted prefill time of ``tokens``; only once a rate was measured."""
        assert self.tokens_per_s is not None
        return tokens / self.tokens_per_s


def moore_hodgson(items: Iterable[tuple[float, float]], start: float
                  ) -> tuple[list[int], list[int]]:
    """Indices of ``items`` ((deadline, service time), in queue order) served on time, in
    deadline order, and the rest (late), in deadline order, when served one after the other
    from ``start``. The on-time list is as long as any order can make it. O(n log n)."""
    items = list(items)
    order = sorted(range(len(items)), key=lambda i: (items[i][0], i))
    doomed = {i for i in order if start + items[i][1] > items[i][0]}
    taken: list[tuple[float, int]] = []  # max-heap of (-service, index)
    finish = start
    for i in order:
        if i in doomed:
            continue
        heapq.heappush(taken, (-items[i][1], i))
        finish += items[i][1]
        if finish > items[i][0]:
            # Each prompt alone fits from ``start`` (the doomed are out), so dropping the
            # longest taken restores every deadline: the classic exchange argument.
            negative_service, dropped = heapq.heappop(taken)
            finish += negative_service
            doomed.add(dropped)
    on_time = [i for i in order if i not in doomed]
    return on_time, [i for i in order if i in doomed]


def slo_rank(prompts: list[tuple[float, float]], start: float, ttft_slo_s: float,
             now: float | None = None, max_wait_s: float | None = None
             ) -> tuple[list[int], int]:
    """Indices of ``prompts`` ((arrival time, service time)) in Moore-Hodgson order on
    the deadline arrival + ``ttft_slo_s`` when served one after the other from ``start``,
    and how many come late. With ``max_wait_s`` (and ``now``), those waiting that long or
    longer come first, in arrival order, each counted late: the bound only binds a prompt
    the order put last."""
    overdue: list[int] = []
    if max_wait_s is not None and now is not None:
        overdue = sorted((i for i, (arrival, _) in enumerate(prompts)
                          if now - arrival >= max_wait_s), key=lambda i: prompts[i][0])
    start += sum(prompts[i][1] for i in overdue)
    first = set(overdue)
    rest = [i for i in range(len(prompts)) if i not in first]
    on_time, late = moore_hodgson([(prompts[i][0] + ttft_slo_s, prompts[i][1]) for i in rest],
                                  start)
    return overdue + [rest[j] for j in on_time + late], len(overdue) + len(late)


class PrefillOrder:
    """Keeps a scheduler's ``waiting`` deque in the configured order."""

    def __init__(self, order: str, ttft_slo_ms: float | None,
                 max_wait_ms: float | None = None) -> None:
        check_prefill_order(order, ttft_slo_ms, max_wait_ms)
        self.order = order
        self.ttft_slo_s = None if ttft_slo_ms is None else ttft_slo_ms / 1e3
        self.max_wait_s = None if max_wait_ms is None else max_wait_ms / 1e3
        self.rate = PrefillRate()
        self.dirty = False  # the queue gained requests since it was last ordered
        self._ordered_at = -1  # ``rate.samples`` then: a launch since moves every estimate
        self._next_overdue_at = math.inf  # a prompt passing the wait bound then moves ahead
        self.reorders = 0
        self.late_last = 0  # prompts put behind the meetable ones by the last reorder

    @property
    def enabled(self) -> bool:
        return self.order == "slo"

    def observe(self, prompt_tokens: int, elapsed_ms: float | None, piece: bool,
                final: bool) -> None:
        if self.enabled:
            self.rate.observe(prompt_tokens, elapsed_ms, piece, final)

    def arrange(self, waiting: deque[Request], running: Iterable[Request],
                now: float | None = None) -> None:
        """Reorders ``waiting`` in place when it changed, a launch completed or a prompt
        passed the wait bound since."""
        if self.order == "priority":
            self._by_priority(waiting)
            return
        if not self.enabled or len(waiting) < 2 or self.rate.tokens_per_s is None:
            return
        unchanged = not self.dirty and self._ordered_at == self.rate.samples
        if unchanged and self._next_overdue_at == math.inf:
            return  # the engine's loop calls this every step: no clock read when idle
        now = time.monotonic() if now is None else now
        if unchanged and now < self._next_overdue_at:
            return
        self.dirty, self._ordered_at = False, self.rate.samples
        backlog = sum(r.num_uncomputed for r in running if r.num_uncomputed > 1)
        ordered, self.late_last = self._ordered(list(waiting), now + self.rate.seconds(backlog),
                                                now)
        waiting.clear()
        waiting.extend(ordered)
        self.reorders += 1
        self._next_overdue_at = self._first_overdue(waiting, now)

    def _by_priority(self, waiting: deque[Request]) -> None:
        if not self.dirty:
            return
        self.dirty = False
        resumed = [r for r in waiting if r.num_output_tokens > 0]
        fresh = sorted((r for r in waiting if r.num_output_tokens == 0),
                       key=lambda r: (r.params.priority, r.arrival_time))
        if len(fresh) > 1:
            waiting.clear()
            waiting.extend(resumed + fresh)
            self.reorders += 1

    def _first_overdue(self, waiting: Iterable[Request], now: float) -> float:
        """When the next prompt waiting passes the bound (no bound, none: never): while only
        decodes run no launch teaches the rate, and the queue must still be reordered then."""
        if self.max_wait_s is None:
            return math.inf
        return min((r.arrival_time + self.max_wait_s for r in waiting
                    if r.num_output_tokens == 0 and now - r.arrival_time < self.max_wait_s),
                   default=math.inf)  # resumed requests keep the front: no bound to pass

    def _ordered(self, queue: list[Request], start: float, now: float
                 ) -> tuple[list[Request], int]:
        resumed = [r for r in queue if r.num_output_tokens > 0]
        fresh = [(r, r.arrival_time, r.num_uncomputed) for r in queue
                 if r.num_output_tokens == 0]
        ranked, late = self.rank(fresh, start, now)
        return resumed + ranked, late

    def rank(self, prompts: list[tuple[T, float, int]], start: float,
             now: float | None = None) -> tuple[list[T], int]:
        """``prompts`` ((prompt, arrival time, tokens to prefill)) in ``slo_rank`` order at
        the learned rate, and how many of them come late. Needs a rate
        (``rate.tokens_per_s``)."""
        indices, late = slo_rank([(arrival, self.rate.seconds(tokens))
                                  for _, arrival, tokens in prompts],
                                 start, self.ttft_slo_s, now, self.max_wait_s)
        return [prompts[i][0] for i in indices], late

    def describe(self) -> dict:
        if self.order == "fcfs":
            return {"prefill_order": self.order}
        described = {"prefill_order": self.order, "prefill_order_reorders": self.reorders}
        if self.enabled:
            rate = self.rate.tokens_per_s
            described.update(
                prefill_order_rate_tokens_per_s=None if rate is None else round(rate),
                prefill_order_max_wait_ms=None if self.max_wait_s is None
                else round(self.max_wait_s * 1e3))
        return described
