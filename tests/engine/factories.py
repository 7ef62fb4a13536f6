"""Requests and hand-made step outputs for scheduler tests: no model, no weights."""

from __future__ import annotations

from pdserve.cache.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.sched.base import Plan, StepOutput
from pdserve.sched.policies import make_scheduler

_next_id = iter(range(1_000_000))


def make_request(num_prompt: int, max_tokens: int = 4, first_token: int = 10) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(f"r{next(_next_id)}", prompt, params, eos_token_ids=[2])


def make_scheduler_for(schedule: str, num_blocks: int = 64, block_size: int = 4, **config):
    blocks = BlockManager(num_blocks, block_size)
    return make_scheduler(SchedulerConfig(schedule=schedule, **config), blocks, 4096)


def fake_output(plan: Plan, token: int = 7) -> StepOutput:
    return StepOutput(token_ids=[token] * len(plan.sampling))


def run_to_completion(scheduler, max_steps: int = 1000) -> list[Plan]:
    plans = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return plans
        plan = scheduler.plan_step()
        plans.append(plan)
        scheduler.update(plan, fake_output(plan))
        scheduler.blocks.check_integrity(list(scheduler.running) + list(scheduler.waiting))
    raise AssertionError("did not finish")
