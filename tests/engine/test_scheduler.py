from __future__ import annotations

from tests.engine.factories import fake_output, make_request, make_scheduler_for, run_to_completion


def test_chunked_puts_decodes_first_and_fills_budget_with_chunks():
    sched = make_scheduler_for("chunked", chunk_size=8)
    decoding, long = make_request(3), make_request(20)
    sched.add(decoding)
    plan = sched.plan_step()
    sched.update(plan, fake_output(plan))
    sched.add(long)
    plan = sched.plan_step()
    assert [s.request for s in plan.decodes] == [decoding]
    assert [(s.request, s.num_new_tokens) for s in plan.prefills] == [(long, 7)]
    assert plan.num_tokens == 8 and not plan.prefills[0].samples


def test_chunked_never_exceeds_budget_and_finishes_everything():
    sched = make_scheduler_for("chunked", chunk_size=16)
    requests = [make_request(n, max_tokens=5) for n in (30, 3, 17, 1, 40)]
    for request in requests:
        sched.add(request)
    plans = run_to_completion(sched)
    assert all(plan.num_tokens <= 16 for plan in plans)
    assert all(r.num_output_tokens == 5 and r.finish_reason == "length" for r in requests)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_prefill_first_pauses_decodes_while_prompts_wait():
    sched = make_scheduler_for("prefill-first", max_num_batched_tokens=64)
    first = make_request(5)
    sched.add(first)
    sched.update(plan := sched.plan_step(), fake_output(plan))
    second = make_request(6)
    sched.add(second)
    plan = sched.plan_step()
    assert not plan.decodes and [s.request for s in plan.prefills] == [second]
    sched.update(plan, fake_output(plan))
    plan = sched.plan_step()
    assert {s.request for s in plan.decodes} == {first, second} and not plan.prefills


def test_prefill_first_splits_prompts_longer_than_budget():
    sched = make_scheduler_for("prefill-first", max_num_batched_tokens=16)
    request = make_request(40)
    sched.add(request)
    plans = run_to_completion(sched)
    assert [p.num_tokens for p in plans[:3]] == [16, 16, 8]


def test_out_of_blocks_preempts_newest_and_recomputes():
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output tokens cannot both fit.
    sched = make_scheduler_for("chunked", num_blocks=6, block_size=4, chunk_size=64)
    old, new = make_request(8, max_tokens=8), make_request(8, max_tokens=8, first_token=50)
    sched.add(old)
    sched.add(new)
    plans = run_to_completion(sched)
    assert any(new in plan.preempted for plan in plans)
    assert not any(old in plan.preempted for plan in plans)
    assert old.num_output_tokens == new.num_output_tokens == 8
    assert new.num_preemptions >= 1


def test_abort_frees_blocks_of_running_and_waiting():
    sched = make_scheduler_for("chunked", chunk_size=4)
    running, waiting = make_request(10), make_request(10)
    sched.add(running)
    sched.update(plan := sched.plan_step(), fake_output(plan))
    sched.add(waiting)
    assert sched.abort(running.request_id) is running
    assert sched.abort(waiting.request_id) is waiting
    assert sched.abort("unknown") is None
    assert running.finish_reason == "abort" and not sched.has_work()
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_max_num_seqs_caps_running():
    sched = make_scheduler_for("chunked", chunk_size=64, max_num_seqs=2)
    for _ in range(4):
        sched.add(make_request(2))
    sched.plan_step()
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_activation_reserve_follows_the_schedules_largest_step():
    from pdserve.config import SchedulerConfig
    from pdserve.engine.model_runner import largest_step_tokens

    assert largest_step_tokens(SchedulerConfig(schedule="chunked", chunk_size=512)) == 512
    assert largest_step_tokens(SchedulerConfig(schedule="prefill-first",
                                               max_num_batched_tokens=4096)) == 4096
    assert largest_step_tokens(SchedulerConfig(schedule="multiplex", chunk_size=512,
                                               max_num_batched_tokens=8192)) == 8192
