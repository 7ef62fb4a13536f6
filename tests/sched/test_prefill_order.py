"""The SLO-aware admission order (``--prefill-order slo``): Moore-Hodgson on hand-built
queues, late prompts still served, running prefills untouched, the flag's validation, and
every policy on the tiny CPU model."""

from __future__ import annotations

import time
from collections import deque

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import SchedulerConfig
from pdserve.sched.base import StepOutput, Work
from pdserve.sched.prefill_order import PrefillOrder, PrefillRate, moore_hodgson
from tests.engine.factories import fake_output, make_request, make_scheduler_for

RATE = 1000.0  # prompt tokens per second taught to the order in these tests


def _taught(order: PrefillOrder) -> PrefillOrder:
    order.rate.observe(int(RATE), 1000.0)  # one launch: 1000 tokens in one second
    return order


def _queue(specs: list[tuple[int, float]]):
    """Requests of (prompt tokens, arrival time in s), in that queue order."""
    requests = []
    for tokens, arrival in specs:
        request = make_request(tokens)
        request.arrival_time = arrival
        requests.append(request)
    return requests


def _met(order: list, start: float, slo_s: float) -> int:
    """Prompts whose prefill ends within their deadline when served in ``order`` from
    ``start`` at ``RATE``, one after the other."""
    met, now = 0, start
    for request in order:
        now += request.num_uncomputed / RATE
        met += now <= request.arrival_time + slo_s
    return met


def test_a_long_prompt_moves_behind_two_it_would_make_late():
    long, short_a, short_b = queue = _queue([(4000, 0.0), (1000, 0.1), (1000, 0.2)])
    order = _taught(PrefillOrder("slo", 4500.0))
    waiting = deque(queue)
    order.arrange(waiting, running=[], now=0.2)
    assert list(waiting) == [short_a, short_b, long]
    assert order.late_last == 1
    assert _met(list(waiting), 0.2, 4.5) == 2
    assert _met(queue, 0.2, 4.5) == 1  # first come, first served: only the long one


def test_moore_hodgson_keeps_deadline_order_when_every_deadline_is_met():
    on_time, late = moore_hodgson([(3.0, 1.0), (1.0, 0.5), (2.0, 0.5)], start=0.0)
    assert (on_time, late) == ([1, 2, 0], [])


def test_moore_hodgson_drops_the_longest_taken_not_the_newest():
    # Taking the third overruns: the 3 s job goes, the two short ones both make it.
    on_time, late = moore_hodgson([(3.5, 3.0), (4.0, 0.5), (4.2, 1.0)], start=0.0)
    assert (on_time, late) == ([1, 2], [0])


def test_a_prompt_past_its_deadline_goes_last_and_is_still_served():
    now = time.monotonic()  # what ``schedule`` orders against
    doomed, fresh = _queue([(40, now - 10.0), (40, now)])  # the first one's deadline passed
    scheduler = make_scheduler_for("chunked", chunk_size=40, prefill_order="slo",
                                   ttft_slo_ms=5000.0)
    _taught(scheduler.prefill_order)
    for request in (doomed, fresh):
        scheduler.add(request)
    admitted = _run(scheduler)
    assert admitted.index(fresh.request_id) < admitted.index(doomed.request_id)
    assert doomed.is_finished and doomed.finish_reason == "length"


def _doomed_and_two_meetable():
    """At 10 s with a 2 s SLO: a prompt past its deadline, and two that make theirs if
    served before it."""
    return _queue([(2000, 0.0), (500, 9.0), (500, 9.5)])


def _arranged(queue: list, max_wait_ms: float | None, now: float):
    order = _taught(PrefillOrder("slo", 2000.0, max_wait_ms=max_wait_ms))
    waiting = deque(queue)
    order.arrange(waiting, running=[], now=now)
    return order, waiting


def test_a_prompt_past_the_wait_bound_goes_ahead_of_prompts_that_can_still_make_it():
    """Unbounded, the doomed prompt waits behind every meetable one; past the bound it goes
    first, and the two it goes ahead of come late: what the bound costs."""
    doomed, first, second = queue = _doomed_and_two_meetable()
    unbounded, waiting = _arranged(queue, None, now=10.0)
    assert list(waiting) == [first, second, doomed] and unbounded.late_last == 1
    bounded, waiting = _arranged(queue, 8000.0, now=10.0)  # doomed has waited 10 s > 8 s
    assert list(waiting) == [doomed, first, second] and bounded.late_last == 3
    assert bounded.describe()["prefill_order_max_wait_ms"] == 8000


def test_the_queue_is_reordered_when_a_prompt_passes_the_bound_without_a_launch():
    """Decode-only launches teach no rate: passing the bound alone must trigger the reorder."""
    doomed, first, second = queue = _doomed_and_two_meetable()
    order, waiting = _arranged(queue, 11000.0, now=10.0)
    assert list(waiting) == [first, second, doomed]
    order.arrange(waiting, running=[], now=10.5)  # nothing changed, no launch, none due
    assert order.reorders == 1
    order.arrange(waiting, running=[], now=11.0)  # doomed has now waited 11 s
    assert list(waiting)[0] is doomed and order.reorders == 2


def test_a_prompt_under_the_wait_bound_keeps_its_place():
    long, short_a, short_b = queue = _queue([(4000, 0.0), (1000, 0.1), (1000, 0.2)])
    order = _taught(PrefillOrder("slo", 4500.0, max_wait_ms=1000.0))
    waiting = deque(queue)
    order.arrange(waiting, running=[], now=0.2)
    assert list(waiting) == [short_a, short_b, long]


def test_fcfs_leaves_the_queue_as_it_came():
    now = time.monotonic()
    doomed, fresh = _queue([(40, now - 10.0), (40, now)])
    scheduler = make_scheduler_for("chunked", chunk_size=40)
    _taught(scheduler.prefill_order)
    for request in (doomed, fresh):
        scheduler.add(request)
    assert _run(scheduler) == [doomed.request_id, fresh.request_id]


def _run(scheduler, max_steps: int = 200) -> list[str]:
    """Drives ``scheduler`` through ``schedule`` (where the order is kept) to the end;
    returns request ids in the order they were first planned."""
    first_planned: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return first_planned
        work = scheduler.schedule()["main"]
        for item in work.plan.scheduled:
            if item.request.request_id not in first_planned:
                first_planned.append(item.request.request_id)
        scheduler.update(work.plan, fake_output(work.plan))
    raise AssertionError("did not finish")


def test_a_partly_prefilled_prompt_keeps_its_progress_and_its_place():
    scheduler = make_scheduler_for("chunked", chunk_size=32, prefill_order="slo",
                                   ttft_slo_ms=5000.0, overlap_schedule=False)
    _taught(scheduler.prefill_order)
    now = time.monotonic()
    (long,) = _queue([(100, now)])
    scheduler.add(long)
    work = scheduler.schedule()["main"]
    scheduler.update(work.plan, fake_output(work.plan))
    assert long.num_computed == 32
    for request in _queue([(8, now + 0.1), (8, now + 0.1)]):  # shorter, later, still meetable
        scheduler.add(request)
    plan = scheduler.schedule()["main"].plan
    assert long.num_computed == 32 and long in scheduler.running
    assert plan.prefills[0].request is long and plan.prefills[0].num_new_tokens == 32


def test_a_preempted_request_with_output_keeps_the_front():
    resumed, early = _queue([(1000, 5.0), (1000, 0.0)])
    resumed.append_token(7, None)  # it had its first token before it was preempted
    order = _taught(PrefillOrder("slo", 5000.0))
    waiting = deque([resumed, early])
    order.arrange(waiting, running=[], now=5.0)
    assert list(waiting) == [resumed, early]


def test_the_rate_counts_a_batch_run_as_pieces_once():
    rate = PrefillRate()
    rate.observe(500, 100.0, piece=True, final=False)
    rate.observe(0, 5.0)  # a decode step on the other lane meanwhile: no sample
    rate.observe(500, 150.0, piece=True, final=True)
    assert rate.samples == 1 and rate.tokens_per_s == pytest.approx(500 / 0.25)


def test_a_launch_with_prompt_tokens_teaches_the_scheduler():
    scheduler = make_scheduler_for("chunked", chunk_size=64, prefill_order="slo",
                                   ttft_slo_ms=1000.0)
    scheduler.add(make_request(64))
    work = scheduler.schedule()["main"]
    scheduler.observe_launch(work, StepOutput([7], elapsed_ms=32.0))
    assert scheduler.prefill_order.rate.tokens_per_s == pytest.approx(2000.0)
    scheduler.observe_launch(Work(work.plan), StepOutput([7], elapsed_ms=None))
    assert scheduler.prefill_order.rate.samples == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"prefill_order": "slo"}, "set --ttft-slo-ms"),
    ({"prefill_order": "slo", "ttft_slo_ms": 0.0}, "set --ttft-slo-ms"),
    ({"prefill_order": "edf", "ttft_slo_ms": 100.0}, "expected one of fcfs, slo"),
    ({"prefill_order_max_wait_ms": 1000.0}, "set --prefill-order slo"),
    ({"prefill_order": "slo", "ttft_slo_ms": 100.0, "prefill_order_max_wait_ms": 0.0},
     "must be positive"),
])
def test_the_flag_is_refused_without_a_deadline_or_with_an_unknown_order(options, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**options)


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
OPTIONS = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64, "chunk_size": 48,
           "num_blocks": 64, "disagg_prefill_kv_fraction": 0.5}
PROMPTS = [[3 + (i * 7 + j) % 240 for j in range(10 + 17 * (i % 4))] for i in range(8)]


@pytest.fixture(scope="module")
def fcfs_tokens():
    with LLM("tiny", **OPTIONS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("schedule", ["prefill-first", "chunked", "multiplex", "disagg"])
def test_every_policy_serves_every_request_in_slo_order(fcfs_tokens, schedule):
    with LLM("tiny", schedule=schedule, prefill_order="slo", ttft_slo_ms=50.0,
             **OPTIONS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        info = llm.engine.describe()
    assert [o.outputs[0].token_ids for o in outputs] == fcfs_tokens
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert info["prefill_order"] == "slo" and info["prefill_order_rate_tokens_per_s"] > 0
    assert info["prefill_order_reorders"] > 0, "the queue was never ordered"


def test_a_wait_bound_serves_every_request_and_is_reported(fcfs_tokens):
    """A bound every prompt passes at once (1 ms): the overdue go first in arrival order,
    and nothing is lost."""
    with LLM("tiny", schedule="chunked", prefill_order="slo", ttft_slo_ms=50.0,
             prefill_order_max_wait_ms=1.0, **OPTIONS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        info = llm.engine.describe()
    assert [o.outputs[0].token_ids for o in outputs] == fcfs_tokens
    assert info["prefill_order_max_wait_ms"] == 1


def test_the_priority_order_admits_lower_priority_first_and_keeps_resumed_ahead():
    queue = _queue([(100, 0.0), (100, 1.0), (100, 2.0), (100, 3.0)])
    for request, priority in zip(queue, (5, -1, 5, 0), strict=True):
        request.params = SamplingParams(priority=priority)
    resumed = queue[2]
    resumed.append_token(7, None)  # preempted after its first token: keeps the front
    order = PrefillOrder("priority", None)
    waiting = deque(queue)
    order.dirty = True
    order.arrange(waiting, running=[])
    assert list(waiting) == [resumed, queue[1], queue[3], queue[0]]
    assert order.describe() == {"prefill_order": "priority", "prefill_order_reorders": 1}


def test_every_policy_serves_every_request_in_priority_order(fcfs_tokens):
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, priority=-i)
              for i in range(len(PROMPTS))]
    for schedule in ("prefill-first", "chunked", "multiplex", "disagg"):
        with LLM("tiny", schedule=schedule, prefill_order="priority", **OPTIONS) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            assert llm.engine.describe()["prefill_order_reorders"] > 0
        assert [o.outputs[0].token_ids for o in outputs] == fcfs_tokens, schedule
    with LLM("tiny", **OPTIONS) as llm, pytest.raises(Exception, match="--prefill-order priority"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params[1])


def test_the_chunked_scheduler_plans_prompts_in_priority_order():
    queue = _queue([(40, 0.0), (40, 0.1), (40, 0.2)])
    for request, priority in zip(queue, (2, 1, 0), strict=True):
        request.params = SamplingParams(max_tokens=2, ignore_eos=True, priority=priority)
    scheduler = make_scheduler_for("chunked", chunk_size=40, prefill_order="priority")
    for request in queue:
        scheduler.add(request)
    assert _run(scheduler) == [r.request_id for r in reversed(queue)]
