"""Overlap scheduling: the next step is planned and issued before the last one's tokens are
applied, its input ids naming those tokens on the device. Everything a user sees must equal
the synchronous engine's: tokens, stops (found one step late, never a token past them),
aborts, preemption, seeded sampling; and no page may leak at any step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cli import build_parser
from pdserve.config import engine_config_from_args
from pdserve.engine.batch import BlockTables, build_host_batch, resolve_placeholders
from pdserve.sched.base import Plan, ScheduledRequest, Scheduler, StepOutput
from tests.engine.factories import make_request, make_scheduler_for

OPTIONS = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64, "chunk_size": 48}
SYNC_SCHEDULES = ("prefill-first", "chunked")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompts(count: int = 6, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))]
            for i in range(count)]


def _engine(schedule: str, overlap: bool, **options):
    return LLM("tiny", schedule=schedule, overlap_schedule=overlap, **{**OPTIONS, **options}).engine


def _drive(engine, requests: dict[str, tuple[list[int], SamplingParams]], on_step=None):
    """Runs to the end; checks integrity after every step and that no update follows a
    request's last one. Returns ({id: tokens}, {id: finish reason})."""
    tokens = {rid: [] for rid in requests}
    finish = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for step in range(2000):
        if not engine.has_work():
            return tokens, finish
        if on_step is not None:
            on_step(engine, step, tokens)
        for update in engine.step():
            assert update.request_id not in finish, f"{update.request_id}: update after its end"
            tokens[update.request_id] += update.new_token_ids
            if update.finished:
                finish[update.request_id] = update.finish_reason
        engine.check_integrity()
    raise AssertionError("did not finish")


def _overlap_info(engine) -> dict:
    return engine.describe()["overlap_schedule"]


def _both(schedule: str, requests, **options):
    """(tokens, finish, overlap info) with overlap on, then off."""
    results = []
    for overlap in (True, False):
        engine = _engine(schedule, overlap, **options)
        results.append((*_drive(engine, requests), _overlap_info(engine)))
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and not engine.requests
    return results


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_max_tokens_exact_and_nothing_computed_past_it(schedule):
    requests = {f"m{i}": (p, SamplingParams(max_tokens=1 + i % 4, temperature=0,
                                             ignore_eos=True))
                for i, p in enumerate(_prompts())}
    (on, on_finish, info), (off, off_finish, off_info) = _both(schedule, requests)
    assert on == off and on_finish == off_finish
    for rid, (_, params) in requests.items():
        assert len(on[rid]) == params.max_tokens and on_finish[rid] == "length"
    assert info["enabled"] and info["overlapped_steps"] > 0
    # A length limit is known when the last token is issued: no step runs past it.
    assert info["dropped_tokens"] == 0
    assert not off_info["enabled"] and off_info["overlapped_steps"] == 0
    assert off_info["off_because"] == "--no-overlap-schedule"


def _stop_token(tokens: list[int]) -> int:
    """A token first sampled part-way through, else the first token (the tiny model often
    repeats one token: then the request stops at its first, sampled by the prefill step)."""
    for index in range(1, len(tokens) - 1):
        if tokens[index] not in tokens[:index]:
            return tokens[index]
    return tokens[0]


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_stop_token_found_one_step_late_emits_nothing_past_it(schedule):
    prompts = _prompts()
    engine = _engine(schedule, overlap=False)
    plain, _ = _drive(engine, {f"s{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    requests = {}
    for i, p in enumerate(prompts):
        stop = _stop_token(plain[f"s{i}"])
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                stop_token_ids=[stop])
        requests[f"s{i}"] = (p, params)
    (on, on_finish, info), (off, off_finish, _) = _both(schedule, requests)
    assert on == off and on_finish == off_finish
    for rid, (_, params) in requests.items():
        want = plain[rid][: plain[rid].index(params.stop_token_ids[0]) + 1]
        assert on[rid] == want and on_finish[rid] == "stop"
    # The step after each stop had already been issued: its token was computed, then dropped.
    assert info["dropped_tokens"] > 0


def test_stop_strings_abort_as_without_overlap():
    prompt = "the quick brown fox"
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM("tiny", overlap_schedule=False, **OPTIONS).generate(prompt, base)[0].outputs[0]
    assert len(plain.text) > 8, "the tiny model's text must be long enough to stop in"
    stop = plain.text[4:7]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    outputs = []
    for overlap in (True, False):
        llm = LLM("tiny", overlap_schedule=overlap, **OPTIONS)
        outputs.append(llm.generate(prompt, params)[0].outputs[0])
        llm.engine.check_integrity()
        assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    on, off = outputs
    assert (on.text, on.token_ids, on.finish_reason) == (off.text, off.token_ids, off.finish_reason)
    assert on.finish_reason == "stop" and stop not in on.text
    assert len(on.token_ids) < len(plain.token_ids)


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_abort_while_its_next_step_is_in_flight(schedule):
    prompts = _prompts()
    requests = {f"a{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    plain, _ = _drive(_engine(schedule, overlap=False), requests)
    seen_in_flight = []

    def abort_mid_flight(engine, step, tokens):
        launch = engine.in_flight("main")
        if seen_in_flight or launch is None or len(tokens["a1"]) < 3:
            return
        assert any(s.request.request_id == "a1" for s in launch.plan.scheduled)
        seen_in_flight.append(step)
        engine.abort_request("a1")

    engine = _engine(schedule, overlap=True)
    tokens, finish = _drive(engine, requests, on_step=abort_mid_flight)
    assert seen_in_flight, "a1 was never in an overlapped launch between steps"
    assert finish["a1"] == "abort"
    assert tokens["a1"] == plain["a1"][: len(tokens["a1"])] and len(tokens["a1"]) < 10
    for rid in requests:
        if rid != "a1":
            assert tokens[rid] == plain[rid]
    assert _overlap_info(engine)["dropped_tokens"] >= 1


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_seeded_sampling_and_parallel_samples_match(schedule):
    """n > 1 is several requests of one prompt (the server's way): shared prefix pages,
    each with its own seed; seeded draws must come out in the same order as without overlap."""
    prompt = _prompts(1)[0]
    requests = {f"n{k}": (prompt, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9,
                                                 seed=100 + k, ignore_eos=True))
                for k in range(4)}
    (on, on_finish, info), (off, off_finish, _) = _both(schedule, requests)
    assert on == off and on_finish == off_finish
    assert len({tuple(t) for t in on.values()}) > 1, "different seeds, different samples"
    assert info["overlapped_steps"] > 0


def test_penalties_run_synchronously_and_say_so():
    prompts = _prompts(3)
    requests = {f"p{i}": (p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                            presence_penalty=1.5 if i == 0 else 0.0))
                for i, p in enumerate(prompts)}
    (on, on_finish, info), (off, off_finish, _) = _both("chunked", requests)
    assert on == off and on_finish == off_finish
    assert info["synchronous_steps"]["penalties"] > 0


def test_grammar_requests_run_synchronously_and_say_so():
    pytest.importorskip("llguidance")
    from pdserve.sampling_params import GrammarSpec

    prompts = _prompts(3)
    choice = GrammarSpec("choice", '["yes indeed", "no way at all"]')
    requests = {f"g{i}": (p, SamplingParams(max_tokens=8, temperature=0,
                                            grammar=choice if i == 0 else None))
                for i, p in enumerate(prompts)}
    (on, on_finish, info), (off, off_finish, _) = _both("chunked", requests)
    assert on == off and on_finish == off_finish
    assert info["synchronous_steps"]["grammar"] > 0


def test_flag_and_describe():
    args = build_parser().parse_args(["serve", "--no-overlap-schedule"])
    assert engine_config_from_args(args).scheduler.overlap_schedule is False
    args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(args).scheduler.overlap_schedule is True
    for schedule in ("prefill-first", "multiplex", "disagg"):
        info = _overlap_info(_engine(schedule, overlap=True))
        assert info["enabled"] and "off_because" not in info
        assert "decode" in info["lanes"] or "main" in info["lanes"]


def test_placeholder_ids_resolve_on_the_device():
    """A decode whose last token is still being sampled feeds ``-1 - row`` and the device
    swaps in the token at that row of the lane's sampled tokens."""
    known, pending = make_request(5), make_request(6)
    for request in (known, pending):
        request.block_ids = [0, 1] if request is known else [2, 3]
    known.num_computed = 4  # its fifth prompt token decodes
    pending.num_computed, pending.num_placeholders, pending.placeholder_row = 6, 1, 3
    plan = Plan(decodes=[ScheduledRequest(known, 1), ScheduledRequest(pending, 1)])
    batch = build_host_batch(plan, BlockTables(8), block_size=4)
    assert batch.has_placeholders and batch.input_ids.tolist() == [known.token_ids[4], -4]
    sampled = torch.tensor([50, 51, 52, 53, 54])
    resolved = resolve_placeholders(torch.from_numpy(batch.input_ids), sampled)
    assert resolved.tolist() == [known.token_ids[4], 53]
    assert np.array_equal(batch.positions, [4, 6])


@pytest.mark.parametrize("schedule", SYNC_SCHEDULES)
def test_preempting_a_request_whose_token_is_in_flight(schedule, monkeypatch):
    """A pool too small for every request: victims are chosen while the step before is still
    running, so some are preempted with their last token in flight; it reaches them when that
    step completes, and the tokens equal the synchronous engine's."""
    with_token_in_flight = []
    preempt = Scheduler._preempt

    def watch(self, request, plan):
        with_token_in_flight.append(request.num_placeholders > 0)
        return preempt(self, request, plan)

    monkeypatch.setattr(Scheduler, "_preempt", watch)
    requests = {f"v{i}": (p, GREEDY) for i, p in enumerate(_prompts(8, seed=11))}
    (on, on_finish, _), (off, off_finish, _) = _both(schedule, requests, num_blocks=16)
    assert on == off and on_finish == off_finish
    assert any(with_token_in_flight), "no victim had a token in flight"


def test_scheduler_rules_one_step_late():
    """Without a model: issue advances the counters, the next plan decodes the placeholder,
    a stop found late drops the token already computed and frees the pages at once, and a
    request whose token in flight reaches max_tokens is never planned again."""
    scheduler = make_scheduler_for("chunked", chunk_size=64)
    stops, lasts = make_request(5, max_tokens=9), make_request(6, max_tokens=2)
    stops.params.stop_token_ids = [7]
    stops.params.ignore_eos = False
    for request in (stops, lasts):
        scheduler.add(request)
    first = _issue(scheduler)  # both prefills, each samples its first token
    assert stops.num_computed == 5 and stops.num_placeholders == 1 and stops.num_uncomputed == 1
    second = _issue(scheduler)  # both decode their placeholders
    assert [s.request for s in second.plan.decodes] == [stops, lasts]
    assert lasts in scheduler.retiring, "its second token is its last (max_tokens=2)"
    assert scheduler.update_work(first, StepOutput([7, 8])) == [stops]  # 7: a stop token
    assert stops.block_ids == [] and stops.token_ids[-1] == 7
    third = _issue(scheduler)
    assert third is None, "nothing left to plan: one request ended, the other retires"
    assert scheduler.update_work(second, StepOutput([9, 9])) == [lasts]
    assert stops.token_ids[-1] == 7 and scheduler.overlap.dropped_tokens == 1
    assert lasts.num_output_tokens == 2 and not scheduler.has_work()
    scheduler.blocks.check_integrity([])


def _issue(scheduler):
    work = scheduler.schedule().get("main")
    if work is not None:
        assert work.overlapped
        scheduler.issued(work)
    return work
