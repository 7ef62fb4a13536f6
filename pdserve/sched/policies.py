"""Baseline policies: prefill-first continuous batching, and chunked prefill (Sarathi-Serve)."""

from __future__ import annotations

from pdserve.sched.base import Plan, Scheduler
from pdserve.sched.disagg import DisaggScheduler
from pdserve.sched.multiplex import MultiplexScheduler


class PrefillFirstScheduler(Scheduler):
    """Whole prompts first, decodes paused while a prefill step runs (vLLM's classic policy)."""

    name = "prefill-first"

    def plan_step(self) -> Plan:
        plan = self._schedule_prefills()
        return plan if not plan.is_empty() else self._schedule_decodes()

    def _schedule_prefills(self) -> Plan:
        plan = Plan()
        budget = self.config.max_num_batched_tokens
        # A prompt longer than the budget is prefilled in budget-sized steps, which bounds
        # activation memory; decodes still wait until no prefill work is left.
        for request in [r for r in self.running if r.num_uncomputed > 1]:
            num_new = min(request.num_uncomputed, budget)
            if budget <= 0:
                break
            if not self._grow_or_preempt(request, request.num_computed + num_new, plan):
                break
            plan.add(request, num_new)
            budget -= num_new
        self._admit_waiting(plan, budget)
        return plan

    def _schedule_decodes(self) -> Plan:
        plan = Plan()
        for request in list(self.running):
            # Preempted while making room for an earlier one. Only preemption takes requests
            # out of ``running`` here, and it records them in the plan: that list is usually
            # empty, where ``request not in self.running`` was O(batch) per request.
            if request in plan.preempted:
                continue
            if self._grow_or_preempt(request, request.num_tokens, plan):
                plan.add(request, request.num_uncomputed)
        return plan


class ChunkedPrefillScheduler(Scheduler):
    """A fixed token budget per step: running decodes first, then prefill chunks fill the rest."""

    name = "chunked"

    def describe(self) -> dict:
        return {"chunk_size": self.config.chunk_size}

    def plan_step(self) -> Plan:
        plan = Plan()
        budget = self._schedule_running(plan, self.config.chunk_size)
        self._admit_waiting(plan, budget)
        return plan

    def _schedule_running(self, plan: Plan, budget: int) -> int:
        # Decodes before unfinished prefills, so a long prompt never delays an output token.
        ordered = sorted(self.running, key=lambda r: r.num_uncomputed > 1)
        for request in ordered:
            if budget <= 0:
                break
            if request in plan.preempted:  # see PrefillFirstScheduler._schedule_decodes
                continue
            num_new = min(request.num_uncomputed, budget)
            if self._grow_or_preempt(request, request.num_computed + num_new, plan):
                plan.add(request, num_new)
                budget -= num_new
        return budget


SCHEDULERS = {cls.name: cls for cls in (PrefillFirstScheduler, ChunkedPrefillScheduler,
                                        MultiplexScheduler, DisaggScheduler)}


def make_scheduler(config, block_manager, max_model_len, **policy_args) -> Scheduler:
    """``policy_args``: what a policy that splits the GPU needs (partitions, predictor)."""
    return scheduler_class(config.schedule)(config, block_manager, max_model_len, **policy_args)


def role_refusal(schedule: str) -> str | None:
    """Why ``schedule`` cannot serve a P/D role (prefill or decode instance), or None."""
    if scheduler_class(schedule).serves_pd_roles:
        return None
    return (f"--schedule {schedule} cannot serve a P/D role (it hands KV between its own two "
            "pools); use chunked, prefill-first or multiplex")


def scheduler_class(schedule: str) -> type[Scheduler]:
    try:
        return SCHEDULERS[schedule]
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}; choose from "
                         f"{', '.join(SCHEDULERS)}") from None
