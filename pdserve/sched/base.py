"""The one policy interface: ``schedule(idle_lanes) -> {lane: Work}`` and
``update(work, output)``.

A lane is a slot with at most one launch in flight, two under overlap scheduling (the whole
GPU for the synchronous policies; a decode and a prefill lane for multiplex and disagg).
``EngineCore.step`` collects finished launches (``update``), asks the policy for work on its
idle lanes (``schedule``) and launches it; nothing in the core depends on which policy runs.

Policies differ only in how they fill a launch (which requests advance by how many tokens,
on which SMs); admission, KV growth, preemption, requests whose KV arrives from another
instance, and bookkeeping are shared here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.cache.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.gpu.partitions import Partition
from pdserve.request import Request, RequestStatus
from pdserve.sched.prefill_order import PrefillOrder
from pdserve.sched.steps import StepTimeline

MAIN_LANE = "main"  # the synchronous policies' only lane: the whole GPU
MAIN_POOL = "main"  # the engine's KV pool (disagg cuts it in two)


@dataclass(slots=True, init=False)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool  # this step reaches the end of the known tokens: it yields a new one

    def __init__(self, request: Request, num_new_tokens: int) -> None:
        # One is made per running request per step: no __post_init__ call, no properties.
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.samples = (request.num_computed + num_new_tokens
                        == len(request.token_ids) + request.num_placeholders)  # num_tokens


@dataclass
class Plan:
    """One step's work, decode-first: requests with one new token, then longer ones."""

    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)

    @property
    def sampling(self) -> list[ScheduledRequest]:
        return [s for s in self.scheduled if s.samples]

    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def add(self, request: Request, num_new_tokens: int) -> None:
        target = self.decodes if num_new_tokens == 1 else self.prefills
        target.append(ScheduledRequest(request, num_new_tokens))


@dataclass
class StepOutput:
    """Sampled tokens, one per ``plan.sampling`` entry in that order."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    elapsed_ms: float | None = None  # launch to observed completion, when the engine timed it
    # The launch on the GPU's own clock (CUDA events around it; None elsewhere): from when
    # its stream reached it to its last kernel. Unlike ``elapsed_ms`` it excludes a late
    # look at a finished launch (the host busy with another lane's work meanwhile).
    device_ms: float | None = None


@dataclass(slots=True)
class BatchCarry:
    """A prefill batch run as pieces: the runner keeps its device state here between them."""

    state: object = None


@dataclass(slots=True)
class Work:
    """One launch a policy asks for on one lane.

    ``layers`` set: a layer range of a prefill batch (``carry`` holds the batch's hidden
    state between pieces; the runner fills it on the first piece and the policy passes it
    on to the next). ``layers`` None: the whole model in one launch (decode graphs when the
    batch is pure decode and a graph fits)."""

    plan: Plan
    partition: Partition | None = None  # None: the whole GPU, ordinary stream
    side: str = "decode"  # the partition's stream to launch on: "decode" | "prefill"
    pool: str = MAIN_POOL  # the KV pool whose page ids the plan's requests hold
    layers: tuple[int, int] | None = None
    final: bool = True  # decode steps, whole batches and a batch's last piece: they sample
    carry: object = None
    note: object = None  # the policy's own record of why (e.g. the multiplex plan)
    overlapped: bool = False  # counters advance at issue; the next step is planned meanwhile
    # A whole launch the policy calibrates against: also timed on the device's clock
    # (``StepOutput.device_ms``); the others are not, so their steps record no extra events.
    timed: bool = False
    # Segments the CUDA caching allocator took from the driver while this was issued (a
    # policy that ``watches_allocations``, on a GPU; else 0).
    cuda_mallocs: int = 0
    # How the runner ran a whole launch: "decode_graph", "piecewise_graph" or "eager"
    # ("": not yet issued, or a piece of a prefill batch).
    path: str = ""


class LaneLaunches:
    """A lane's launches in flight, oldest first: one, or two under overlap scheduling."""

    def __init__(self) -> None:
        self._works: deque[Work] = deque()

    def __bool__(self) -> bool:
        return bool(self._works)

    @property
    def newest(self) -> Work | None:
        return self._works[-1] if self._works else None

    def add(self, work: Work) -> Work:
        self._works.append(work)
        return work

    def pop_if_oldest(self, work: Work) -> bool:
        """Takes ``work`` off when it is the oldest (launches complete in order)."""
        if self._works and work is self._works[0]:
            self._works.popleft()
            return True
        return False

    def discard(self, work: Work) -> bool:
        """Takes ``work`` off wherever it is (a failed launch); False when not here."""
        if not any(w is work for w in self._works):
            return False
        self._works = deque(w for w in self._works if w is not work)
        return True


@dataclass(slots=True)
class KVMove:
    """A request's KV copied from one pool's pages to another's (same-GPU disaggregation)."""

    request: Request
    source_pool: str
    source_blocks: list[int]
    target_pool: str
    target_blocks: list[int]
    num_tokens: int
    partition: Partition | None = None  # gather on its prefill stream, scatter on its decode


class Scheduler:
    """Shared state and rules of every policy.

    The base is a synchronous one-lane policy: subclasses implement ``plan_step`` and the
    engine waits for each launch before it schedules the next (``waits_for_launches``)."""

    lanes: tuple[str, ...] = (MAIN_LANE,)
    waits_for_launches = True
    # The engine counts the allocator's cudaMallocs around each of its launches
    # (``Work.cuda_mallocs``): two allocator-stats reads a launch, so only where asked.
    watches_allocations = False
    serves_pd_roles = True  # may run as a P/D prefill or decode instance
    decode_pool = MAIN_POOL  # the pool decode graphs are captured over

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.last_work: Work | None = None  # for stats: what ran most recently
        # Overlap: requests whose tokens in flight finish them (length, hand-off); they hold
        # their pages until those tokens arrive but are never planned again.
        self.retiring: list[Request] = []
        self.overlap = OverlapCounters(config.overlap_schedule)
        self.prefill_order = PrefillOrder(config.prefill_order, config.ttft_slo_ms,
                                          config.prefill_order_max_wait_ms)
        self.steps = StepTimeline()

    # ---- the policy interface ----

    def schedule(self, idle_lanes: tuple[str, ...] = (MAIN_LANE,)) -> dict[str, Work]:
        if MAIN_LANE not in idle_lanes:
            return {}
        self.order_waiting()
        plan = self.plan_step()
        if plan.is_empty():
            return {}
        # Timed on the GPU's clock too: the step timeline keeps both times.
        self.last_work = Work(plan, overlapped=self.overlap.allows(plan), timed=True,
                              note=self.steps.planned(plan))
        return {MAIN_LANE: self.last_work}

    def issued(self, work: Work) -> None:
        """The engine issued ``work``. Overlapped: its counters advance now and each sampled
        token is a placeholder (its row in the lane's device buffer) until it completes, so
        the next step can be planned while it runs."""
        if not work.overlapped:
            return
        for item in work.plan.scheduled:
            item.request.num_computed += item.num_new_tokens
        for row, item in enumerate(work.plan.sampling):
            request = item.request
            request.num_placeholders += 1
            request.placeholder_row = row
            if request.ends_at_pending_tokens(self.max_model_len):
                self.running.remove(request)
                self.retiring.append(request)

    def plan_step(self) -> Plan:
        """One whole-GPU step of this policy."""
        raise NotImplementedError

    def update_work(self, work: Work, output: StepOutput) -> list[Request]:
        """Applies a completed launch; returns the requests that ended (finished or aborted)."""
        self.steps.completed(work, output)
        return self.update(work.plan, output, advanced=work.overlapped)

    def fail(self, work: Work) -> list[Request]:
        """A launch raised: its requests end with an error (others carry on)."""
        failed = []
        for item in work.plan.scheduled:
            request = self.abort(item.request.request_id)
            if request is not None:
                request.finish_reason = "error"
                failed.append(request)
        return failed

    def order_waiting(self) -> None:
        """Puts ``waiting`` in the configured admission order (a no-op under fcfs). Called
        before a step is planned, never between listing candidates and admitting them."""
        self.prefill_order.arrange(self.waiting, self.running)

    def observe_launch(self, work: Work, output: StepOutput) -> None:
        """A completed launch: its prompt tokens and time teach the admission order's rate
        (nothing to learn, so no work on the step loop, under fcfs)."""
        if not self.prefill_order.enabled:
            return
        prompt_tokens = sum(s.num_new_tokens for s in work.plan.prefills)
        self.prefill_order.observe(prompt_tokens, output.elapsed_ms, work.layers is not None,
                                  work.final)

    def take_moves(self) -> list[KVMove]:
        """KV copies between this policy's pools to issue before its next launches."""
        return []

    def pools(self) -> dict[str, BlockManager]:
        return {MAIN_POOL: self.blocks}

    def pool_layout(self) -> dict[str, tuple[int, int]]:
        """(first page, pages) of each pool in the engine's KV tensor."""
        return {MAIN_POOL: (0, self.blocks.num_blocks)}

    def graph_partitions(self) -> list[Partition] | None:
        """Where decode graphs are replayed; None: the whole GPU on the ordinary stream."""
        return None

    def live_requests(self, pool: str) -> list[Request]:
        """Requests holding pages of ``pool`` (for the integrity check)."""
        return list(self.running) + list(self.waiting) + self.retiring

    def describe(self) -> dict:
        """This policy's own set-up (partitions, latency model) for results to record."""
        return {}

    def overlap_lanes(self) -> dict[str, str]:
        """What each lane overlaps under overlap scheduling, and why not where it does not."""
        return {MAIN_LANE: "every step, but those counted in synchronous_steps"}

    def timeline(self, since: float | None = None) -> list[dict]:
        """Every step's shape and time (``StepEntry`` fields), planned at ``since`` or later;
        policies that split the GPU keep their own decisions instead."""
        return self.steps.entries(since)

    def fill_stats(self, stats) -> None:
        """Adds this policy's own figures (its split, its pools) to ``EngineStats``."""
        plan = self.last_work.plan if self.last_work is not None else Plan()
        stats.last_batch_decode = len(plan.decodes)
        stats.last_batch_prefill_tokens = plan.num_tokens - len(plan.decodes)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.prefill_order.dirty = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.retiring)

    def num_running(self) -> int:
        return len(self.running) + len(self.retiring)

    def fits(self, num_tokens: int) -> str | None:
        """Why a request of ``num_tokens`` (prompt + max output) can never run, or None."""
        needed = self.blocks.blocks_needed(num_tokens)
        if needed > self.blocks.num_blocks:
            return f"the request needs {needed} KV blocks; the pool has {self.blocks.num_blocks}"
        return None

    # ---- KV received from a prefill instance (P/D across instances) ----

    received_pool = MAIN_POOL  # where KV from a prefill instance lands

    def reserve_received(self, request: Request) -> list[int] | None:
        """Pages for a request whose prompt KV arrived; None: no room yet (try later)."""
        if len(self.running) >= self.config.max_num_seqs or \
                not self.blocks.grow(request, request.num_prompt_tokens):
            return None
        return list(request.block_ids)

    def join_received(self, request: Request) -> None:
        """The KV is in the reserved pages: the request decodes from its next token on."""
        request.num_computed = request.num_prompt_tokens
        self.blocks.commit(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.retiring, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "abort")
                    return request
        return None

    def update(self, plan: Plan, output: StepOutput, advanced: bool = False) -> list[Request]:
        """Advances counters (unless ``advanced`` at issue), appends sampled tokens; returns
        requests that finished. A request that ended while the launch ran (a stop found one
        step late, an abort) has its token dropped: it was never emitted."""
        logprobs = output.logprobs or [None] * len(output.token_ids)
        sampled = iter(zip(output.token_ids, logprobs, strict=True))
        finished = []
        commit = self._committer()
        for item in plan.scheduled:
            request = item.request
            token = next(sampled) if item.samples else None
            if request.status is RequestStatus.FINISHED:
                self.overlap.dropped_tokens += token is not None
                continue
            if not advanced:
                request.num_computed += item.num_new_tokens
            commit(request)
            if token is None:
                continue
            request.num_placeholders -= advanced
            request.append_token(*token)
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                self._leave(request)
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _committer(self):
        """Offers a request's computed blocks to the prefix cache after a launch."""
        return self.blocks.commit

    def _leave(self, request: Request) -> None:
        """Takes a finishing request out of its queue: running, retiring, or (preempted while
        its last token was in flight) waiting."""
        for queue in (self.running, self.retiring):
            if request in queue:
                queue.remove(request)
                return
        self.waiting.remove(request)

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.blocks.free(request)

    # ---- shared building blocks for policies ----

    def _grow_or_preempt(self, request: Request, num_tokens: int, plan: Plan) -> bool:
        """Grows ``request`` to ``num_tokens``, preempting the newest running requests if needed.

        Returns False when ``request`` itself had to be preempted.
        """
        while not self.blocks.grow(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: Plan) -> None:
        # Recompute, not swap: the request's tokens (prompt and output so far) are prefilled
        # again when it is re-admitted, and the prefix cache may still hold most of them.
        self.running.remove(request)
        self.blocks.free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.prefill_order.dirty = True
        plan.preempted.append(request)

    def _admit_waiting(self, plan: Plan, budget: int) -> int:
        """Admits waiting requests in order while ``budget`` tokens remain; returns the rest.

        Nothing is admitted in a step that had to preempt: the pool is already short.
        """
        while budget > 0 and not plan.preempted:
            admitted = self._try_admit(budget)
            if admitted is None:
                break
            request, num_new = admitted
            plan.add(request, num_new)
            budget -= num_new
        return budget

    def _try_admit(self, budget: int) -> tuple[Request, int] | None:
        """Moves the first waiting request to running with up to ``budget`` tokens to compute."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        request = self.waiting[0]
        # Positions served from the prefix cache have no logits: a request scoring its
        # prompt computes all of it.
        self.blocks.admit(request, use_cache=not request.scores_prompt)
        num_new = min(request.num_uncomputed, budget)
        if num_new <= 0 or not self.blocks.grow(request, request.num_computed + num_new):
            self.blocks.free(request)
            request.num_computed = 0
            return None
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request, num_new


class OverlapCounters:
    """Whether launches overlap planning, and every step that could not, by reason."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.overlapped_steps = 0
        self.synchronous_steps = {"penalties": 0, "grammar": 0, "bad_words": 0}
        self.dropped_tokens = 0  # computed one step past a stop or an abort, never emitted
        # Multiplex's whole-GPU mixed steps: issued behind one still running on the same
        # stream ("chained"), or only once the decode lane had drained ("after_drain": the
        # GPU waited while the host planned and built it).
        self.mixed_steps = {"chained": 0, "after_drain": 0}

    def synchronous(self, reason: str) -> None:
        """Counts a step its policy runs synchronously by design (``reason``)."""
        if self.enabled:
            self.synchronous_steps[reason] = self.synchronous_steps.get(reason, 0) + 1

    def mixed_step(self, chained: bool) -> None:
        if self.enabled:
            self.mixed_steps["chained" if chained else "after_drain"] += 1

    def allows(self, plan: Plan) -> bool:
        # Penalties count the request's output tokens on the host: a token still on the
        # device would be missing from the counts, so its next step waits for it.
        if not self.enabled:
            return False
        if any(s.request.params.penalized for s in plan.sampling):
            self.synchronous_steps["penalties"] += 1
            return False
        # A grammar's next mask follows from the token this step samples: the matcher must
        # have taken it on the host before the next step of that request is planned.
        if any(s.request.grammar is not None for s in plan.sampling):
            self.synchronous_steps["grammar"] += 1
            return False
        # A bad word of several tokens is refused by what the output ends with.
        if any(s.request.bad_words_follow_output for s in plan.sampling):
            self.synchronous_steps["bad_words"] += 1
            return False
        self.overlapped_steps += 1
        return True

    def describe(self) -> dict:
        return {"enabled": self.enabled, "overlapped_steps": self.overlapped_steps,
                "synchronous_steps": dict(self.synchronous_steps),
                "dropped_tokens": self.dropped_tokens, "mixed_steps": dict(self.mixed_steps)}
