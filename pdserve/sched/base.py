"""The scheduler interface: ``schedule()`` returns a plan, ``update(plan, output)`` applies it.

Policies differ only in how they fill a step (which requests advance by how many tokens);
admission, KV growth, preemption and bookkeeping are shared here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.cache.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.request import Request, RequestStatus


@dataclass(slots=True, init=False)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool  # this step reaches the end of the known tokens: it yields a new one

    def __init__(self, request: Request, num_new_tokens: int) -> None:
        # One is made per running request per step: no __post_init__ call, no properties.
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.samples = request.num_computed + num_new_tokens == len(request.token_ids)


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


class Scheduler:
    """Shared state and rules; subclasses implement ``schedule``."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def schedule(self) -> Plan:
        raise NotImplementedError

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "abort")
                    return request
        return None

    def update(self, plan: Plan, output: StepOutput) -> list[Request]:
        """Advances counters, appends sampled tokens; returns requests that finished."""
        logprobs = output.logprobs or [None] * len(output.token_ids)
        sampled = iter(zip(output.token_ids, logprobs, strict=True))
        finished = []
        commit = self.blocks.commit
        for item in plan.scheduled:
            request = item.request
            request.num_computed += item.num_new_tokens
            commit(request)
            if not item.samples:
                continue
            token_id, logprob = next(sampled)
            request.append_token(token_id, logprob)
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
                finished.append(request)
        return finished

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
        self.blocks.admit(request)
        num_new = min(request.num_uncomputed, budget)
        if num_new <= 0 or not self.blocks.grow(request, request.num_computed + num_new):
            self.blocks.free(request)
            request.num_computed = 0
            return None
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request, num_new
