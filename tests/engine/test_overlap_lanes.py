"""Overlap scheduling on the decode lanes of multiplex and disagg: emulated partitions on the
CPU, fake latencies for planning, and fake events that complete a set number of engine steps
late (never by the host's clock), so a decode step is issued while the one before it is
still in flight and feeds on its tokens as placeholders.
Everything a user sees must equal the engine without overlap (tokens, stops found one step
late, max_tokens, aborts), no page may leak at any step, and a request that ends while a
decode still computes for it keeps its pages until that decode completes."""

from __future__ import annotations

import math
import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.cache.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.engine.setup import EngineSetup
from pdserve.gpu.driver import FakeDriver
from pdserve.gpu.partitions import PartitionSet
from pdserve.sched.base import StepOutput, Work
from pdserve.sched.in_flight import InFlightScheduler
from tests.engine.factories import make_request
from tests.engine.test_disagg import NAMED
from tests.engine.test_multiplex import (
    HeldOps,
    SliceModel,
    SplitModel,
    StepOps,
    _multiplex,
    _prompts,
    ticking,
)
from tests.engine.test_overlap import _drive, _overlap_info, _stop_token

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


class TemporalModel(SplitModel):
    """Mixed steps cheap, co-running decode ruinous: the planner picks TEMPORAL."""

    def predict_mixed(self, *args, **kwargs):
        return 1.0

    def predict(self, phase, num_tokens, context_tokens, batch_size, sms, co_running=False,
                num_layers=None):
        ms = super().predict(phase, num_tokens, context_tokens, batch_size, sms, False,
                             num_layers)
        return ms * 100 if co_running else ms


def _unclocked(llm: LLM, predictor) -> LLM:
    """Planning on the fake latencies alone: no learning from the host's timing (as in
    test_multiplex) and no stall rule, which counts how long prompts waited by its clock."""
    policy = llm.engine.scheduler
    policy.set_predictor(predictor, max_prefill_stall_ms=math.inf)
    policy.model.weight = 0.0
    return llm


def _mux_llm(folder: str, overlap: bool, ops=None, predictor=None, seed: int = 3,
             **options) -> LLM:
    partitions = PartitionSet.build(FakeDriver(), [16, 24, 32])
    predictor = predictor or SplitModel(2)
    ops = ops or StepOps(seed)
    llm = _multiplex(folder, predictor=predictor, ops=ops, partitions=partitions,
                     overlap_schedule=overlap, **options)
    return _unclocked(llm, predictor)  # _multiplex ticks StepOps itself


def _mux(folder: str, overlap: bool, **options):
    return _mux_llm(folder, overlap, **options).engine


def _disagg_llm(overlap: bool, ops=None, **options) -> LLM:
    steps = ops or StepOps(seed=1)
    setup = EngineSetup(disagg_partition=NAMED, ops=steps)
    options = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64, **options}
    llm = LLM("tiny", schedule="disagg", setup=setup, overlap_schedule=overlap, **options)
    return ticking(llm, steps) if isinstance(steps, StepOps) else llm


def _disagg(overlap: bool, ops=None, **options):
    return _disagg_llm(overlap, ops, **options).engine


def _watch_placeholders(engine) -> list[int]:
    """Per decode-lane launch: how many of its requests feed a token still being sampled.
    Such a launch must follow the decode-lane launch in flight on its very partition (its
    stream): a decode behind a decode, a mixed step behind a mixed step."""
    fed, launch = [], engine.runner.launch

    def spy(work, *args, **kwargs):
        if work.side == "decode":
            fed.append(sum(s.request.num_placeholders > 0 for s in work.plan.decodes))
        if work.side == "decode" and fed[-1]:
            before = engine.in_flight("decode")
            assert before is not None and before.work.overlapped
            assert before.work.partition is work.partition
            assert _is_mixed(before.work) == _is_mixed(work)
            assert _is_mixed(work) or not work.plan.prefills
        return launch(work, *args, **kwargs)

    engine.runner.launch = spy
    return fed


def _is_mixed(work: Work) -> bool:
    return getattr(work.note, "mixed", None) is not None


def _assert_clean(engine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.requests
    sides = [engine.scheduler]
    if hasattr(engine.scheduler, "decode"):  # disagg: two sides
        sides = [engine.scheduler.prefill, engine.scheduler.decode]
    for side in sides:
        assert not side.in_flight and not side.overlapped and not side.draining


def _on_and_off(make, requests):
    """[(tokens, finish, overlap info, placeholders fed per decode launch)] on, then off."""
    results = []
    for overlap in (True, False):
        engine = make(overlap)
        fed = _watch_placeholders(engine)
        tokens, finish = _drive(engine, requests)
        _assert_clean(engine)
        results.append((tokens, finish, _overlap_info(engine), fed))
    return results


def _multiplex_maker(folder, **options):
    return lambda overlap: _mux(folder, overlap, **options)


def _disagg_maker(**options):
    return lambda overlap: _disagg(overlap, **options)


def _makers(hf_llama):
    folder, _ = hf_llama
    return {"multiplex": _multiplex_maker(folder), "disagg": _disagg_maker(),
            "temporal": _multiplex_maker(folder, predictor=TemporalModel(2))}


@pytest.mark.parametrize("policy", ["multiplex", "disagg"])
def test_decode_lane_overlaps_with_the_same_tokens(hf_llama, policy):
    requests = {f"q{i}": (p, GREEDY) for i, p in enumerate(_prompts(10, vocab=250))}
    (on, on_finish, info, fed), (off, off_finish, off_info, off_fed) = _on_and_off(
        _makers(hf_llama)[policy], requests)
    assert on == off and on_finish == off_finish
    assert all(len(t) == 10 for t in on.values())
    assert info["enabled"] and info["overlapped_steps"] > 0
    assert sum(fed) > 0, "no decode was issued on the tokens of one still in flight"
    assert set(info["lanes"]) == {"decode", "prefill"}
    assert info["lanes"]["prefill"].startswith("not overlapped")
    assert not off_info["enabled"] and off_info["off_because"] == "--no-overlap-schedule"
    assert off_info["overlapped_steps"] == 0 and sum(off_fed) == 0


@pytest.mark.parametrize("policy", ["multiplex", "disagg", "temporal"])
def test_stops_and_length_limits_one_step_late(hf_llama, policy):
    """Stop tokens found one step late emit nothing past them (the decode or mixed step
    already issued has its token dropped); max_tokens is never exceeded and costs no extra
    step. ``temporal``: multiplex's chained mixed steps."""
    make = _makers(hf_llama)[policy]
    prompts = _prompts(10, vocab=250)
    plain, _ = _drive(make(False), {f"s{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    requests = {}
    for i, p in enumerate(prompts):
        rid = f"s{i}"
        stop = [_stop_token(plain[rid])] if i % 2 else []
        requests[rid] = (p, SamplingParams(max_tokens=3 + i % 5, temperature=0,
                                           ignore_eos=True, stop_token_ids=stop))
    (on, on_finish, info, _), (off, off_finish, _, _) = _on_and_off(make, requests)
    assert on == off and on_finish == off_finish
    for rid, (_, params) in requests.items():
        want = plain[rid][:params.max_tokens]
        if params.stop_token_ids and params.stop_token_ids[0] in want:
            want = want[:want.index(params.stop_token_ids[0]) + 1]
            assert on_finish[rid] == "stop"
        else:
            assert on_finish[rid] == "length"
        assert on[rid] == want
    assert info["dropped_tokens"] > 0, "no stop was found with the next decode in flight"
    assert (info["mixed_steps"]["chained"] > 0) == (policy == "temporal")


def _tiny_llm(policy: str, overlap: bool) -> LLM:
    if policy == "disagg":
        return _disagg_llm(overlap)
    predictor = TemporalModel(4) if policy == "temporal" else SplitModel(4)
    return _mux_llm("tiny", overlap, predictor=predictor, seed=2)


@pytest.mark.parametrize("policy", ["multiplex", "disagg", "temporal"])
def test_stop_strings_end_as_without_overlap(policy):
    """A stop string is matched on the text by the offline LLM, which aborts the request:
    the decode in flight then computes one token too many, never seen in the text."""
    prompts = ["the quick brown fox", "pack my box with five", "sphinx of black quartz",
               "how vexingly quick", "jived fox nymph"]
    if policy == "temporal":  # prompts of several chunks: mixed steps follow one another
        prompts += [" ".join([p] * 8) for p in prompts[:2]]
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = [o.outputs[0] for o in _tiny_llm(policy, False).generate(prompts, base)]
    stops = [_stop_string(o.text) for o in plain]
    assert sum(s is not None for s in stops) >= 2, "the tiny model's text must hold stops"
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             stop=[stop] if stop else []) for stop in stops]
    results = []
    for overlap in (True, False):
        llm = _tiny_llm(policy, overlap)
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        _assert_clean(llm.engine)
        results.append([(o.text, o.token_ids, o.finish_reason) for o in outputs])
        info = _overlap_info(llm.engine)
        assert (info["dropped_tokens"] > 0) == overlap, "aborted with its next decode in flight"
        assert (info["mixed_steps"]["chained"] > 0) == (overlap and policy == "temporal")
    assert results[0] == results[1]
    for (text, token_ids, reason), stop, whole in zip(results[0], stops, plain, strict=True):
        if stop is not None:
            assert reason == "stop" and stop not in text
            assert len(token_ids) < len(whole.token_ids)


def _stop_string(text: str) -> str | None:
    """Two characters a few tokens in; not across bytes that decode to no character (the
    random tiny model samples any byte), which the detokenizer holds back."""
    for start in range(3, len(text) - 3):
        if "\ufffd" not in text[start:start + 2]:
            return text[start:start + 2]
    return None


def test_received_kv_joins_beside_a_decode_in_flight():
    """A multiplexing decode instance (P/D across instances, KV over real TCP): requests whose
    KV arrives join the decode that follows one in flight, beside requests fed placeholders,
    and every token equals one engine doing everything."""
    from tests.engine import test_kv_handoff as kv

    prompts = kv._prompts(6, seed=4)
    single = LLM("tiny", **kv.OPTIONS).generate([{"prompt_token_ids": p} for p in prompts],
                                                kv.GREEDY)
    prefill = LLM("tiny", kv_transfer_port=0, **kv.OPTIONS).engine
    decode = _mux("tiny", True, predictor=SplitModel(4), kv_transfer_port=0, num_blocks=64)
    joins = []
    launch = decode.runner.launch

    def spy(work, *args, **kwargs):
        fed = [s.request.num_placeholders > 0 for s in work.plan.decodes]
        joins.append(any(fed) and not all(fed))
        return launch(work, *args, **kwargs)

    decode.runner.launch = spy
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    try:
        first = kv._prefill_all(prefill, decode, prompts)
        # All KV here before any request is added: when each joins depends on steps alone.
        _wait_for(lambda: decode.kv.receiver.pending() == len(prompts))
        for i, prompt in enumerate(prompts):
            if i == 2:  # the rest arrive while the first two decode
                _step_until(decode, tokens, lambda: decode.scheduler.overlapped)
            decode.add_request(f"r{i}", prompt, kv.GREEDY, handoff=kv.KVHandoff(
                f"t{i}", first_token=first[f"r{i}"].new_token_ids[0]))
        _step_until(decode, tokens, lambda: not decode.has_work())
    finally:
        prefill.close()
        decode.close()
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == \
        [o.outputs[0].token_ids for o in single]
    assert any(joins), "no request joined a decode issued behind one in flight"
    _assert_clean(decode)


def _step_until(engine, tokens: dict, done) -> None:
    for _ in range(1000):
        if done():
            return
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
        engine.check_integrity()
    raise AssertionError("the engine did not get there")


def _wait_for(done, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s  # KV crosses a real socket: a bound, not a figure
    while not done():
        assert time.monotonic() < deadline, "the KV never arrived"
        time.sleep(0.01)


def test_preemption_under_overlap_keeps_tokens(hf_llama):
    """A decode pool too small for every request (disagg): victims are never requests a
    decode in flight still uses, and the tokens equal the engine's without overlap."""
    requests = {f"v{i}": (p, GREEDY) for i, p in enumerate(_prompts(10, vocab=250))}
    make = _disagg_maker(num_blocks=56, disagg_prefill_kv_fraction=0.5)
    (on, on_finish, info, fed), (off, off_finish, _, _) = _on_and_off(make, requests)
    assert on == off and on_finish == off_finish
    assert sum(fed) > 0


def _held_multiplex(folder, predictor=None):
    partitions = PartitionSet.build(FakeDriver(), [16, 24, 32])
    streams = {p.decode_stream for p in partitions.choices()}
    ops = HeldOps(streams | {partitions.whole_gpu.decode_stream})
    predictor = predictor or SplitModel(2)
    llm = _multiplex(folder, predictor=predictor, ops=ops, partitions=partitions,
                     overlap_schedule=True)
    engine = _unclocked(llm, predictor).engine
    return engine, ops, engine.scheduler


def _held_disagg():
    ops = HeldOps({"decode", "prefill"})
    engine = _disagg(True, ops=ops)
    return engine, ops, engine.scheduler.decode


def _abort_and_drain(engine, ops, side, request_id: str) -> int:
    """Aborts a request with launches of it in flight: it ends at once, keeps its pages
    until they completed (never an update after its end), then they are free. Returns the
    tokens dropped when it ended."""
    request = engine.requests[request_id]
    engine.abort_request(request_id)
    assert request in side.draining and request.block_ids, "pages held under its launches"
    engine.check_integrity()
    updates = [u for u in engine.step() if u.request_id == request_id]
    assert updates[-1].finished and updates[-1].finish_reason == "abort"
    dropped = _overlap_info(engine)["dropped_tokens"]
    for _ in range(300):
        if not engine.has_work():
            break
        ops.release_all()
        assert not [u for u in engine.step() if u.request_id == request_id], \
            "update after its end"
        engine.check_integrity()
    assert not request.block_ids and not side.draining
    return dropped


@pytest.mark.parametrize("policy", ["multiplex", "disagg"])
def test_abort_while_two_decodes_are_in_flight(hf_llama, policy):
    """Aborted with two decodes of it in flight: it ends at once (nothing more emitted), but
    its pages stay taken until both decodes completed; then they are free."""
    engine, ops, side = _held_multiplex(hf_llama[0]) if policy == "multiplex" \
        else _held_disagg()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 30)), params)
    engine.add_request("b", list(range(40, 60)), params)
    for _ in range(60):  # release until a decodes, then hold it: a second decode follows
        if side.overlapped.get("a") == 2:
            break
        if not side.overlapped.get("a"):
            ops.release_all()
        engine.step()
    assert side.overlapped.get("a") == 2, "a never had two decodes in flight"
    dropped = _abort_and_drain(engine, ops, side, "a")
    assert _overlap_info(engine)["dropped_tokens"] >= dropped + 2
    _assert_clean(engine)


def _watch_mixed(engine) -> list[dict]:
    """Per mixed step issued: whether it was issued behind another still in flight, how many
    of its decodes feed their first token as a placeholder (their prompt ended in the step
    in flight), and how many of its prompt chunks go on from a chunk still in flight."""
    seen, launch = [], engine.runner.launch

    def spy(work, *args, **kwargs):
        if _is_mixed(work):
            before = engine.in_flight("decode")
            owed = engine.scheduler.overlapped
            seen.append({
                "behind": before is not None,
                "first_token_fed": sum(s.request.num_placeholders > 0 and not
                                       s.request.num_output_tokens for s in work.plan.decodes),
                "chunk_goes_on": sum(s.request.request_id in owed for s in work.plan.prefills)})
        return launch(work, *args, **kwargs)

    engine.runner.launch = spy
    return seen


def test_mixed_steps_chain_with_the_same_tokens(hf_llama):
    """TEMPORAL picked at every boundary: the next mixed step is issued behind the one in
    flight, its prompt chunks counted as done, and requests whose prompt ended in it decode
    on their first token as a placeholder; every token equals the engine without overlap."""
    folder, _ = hf_llama
    requests = {f"q{i}": (p, GREEDY) for i, p in enumerate(_prompts(12, vocab=250))}
    results = []
    for overlap in (True, False):
        engine = _mux(folder, overlap, predictor=TemporalModel(2))
        _watch_placeholders(engine)  # checks what each launch fed placeholders follows
        mixed = _watch_mixed(engine)
        tokens, finish = _drive(engine, requests)
        _assert_clean(engine)
        results.append((tokens, finish, _overlap_info(engine), mixed))
    (on, on_finish, info, mixed), (off, off_finish, off_info, off_mixed) = results
    assert on == off and on_finish == off_finish
    assert all(len(t) == 10 for t in on.values())
    counts = info["mixed_steps"]
    assert counts["chained"] == sum(m["behind"] for m in mixed) > 0
    assert counts["after_drain"] == sum(not m["behind"] for m in mixed) > 0
    assert sum(m["first_token_fed"] for m in mixed) > 0, "no first token fed on the device"
    assert sum(m["chunk_goes_on"] for m in mixed) > 0, "no prompt chunk followed its last"
    assert not any(m["behind"] for m in off_mixed) and len(off_mixed) > 0
    assert off_info["mixed_steps"] == {"chained": 0, "after_drain": 0}
    assert off_info["off_because"] == "--no-overlap-schedule"


def test_time_slice_decodes_run_synchronously_and_are_counted(hf_llama):
    folder, _ = hf_llama
    requests = {f"q{i}": (p, GREEDY) for i, p in enumerate(_prompts(8, vocab=250))}
    make = _multiplex_maker(folder, predictor=SliceModel(2),
                            mux_sharing="temporal,time_slice,spatial")
    (on, on_finish, info, _), (off, off_finish, _, _) = _on_and_off(make, requests)
    assert on == off and on_finish == off_finish
    assert info["synchronous_steps"]["time_slice"] > 0


def test_each_decode_is_timed_from_when_the_one_before_it_ended(hf_llama, monkeypatch):
    """A decode issued behind one in flight starts on the device when that one ends: its
    measured cycle (what calibrates its own prediction) runs from there, not from its issue.
    The host clock is replaced by one the test moves."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    engine, ops, side = _held_multiplex(hf_llama[0])
    engine.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=40, temperature=0,
                                                               ignore_eos=True))
    for _ in range(60):
        if side.overlapped.get("a"):
            break
        ops.release_all()
        engine.step()
    first = engine.in_flight("decode")  # issued at 0
    clock["now"] = 1.0
    engine.step()
    second = engine.in_flight("decode")
    assert second is not first and second.work.overlapped and second.issued == 1.0
    clock["now"], first.event.left = 10.0, 0
    engine.step()
    clock["now"], second.event.left = 15.0, 0
    engine.step()
    assert first.work.note.entry is not second.work.note.entry
    assert first.work.note.entry.measured_cycle_ms == 10_000.0
    assert second.work.note.entry.measured_cycle_ms == 5_000.0


def _two_mixed_steps_of(engine, ops, request_id: str) -> list:
    """Releases the device until one mixed step carrying ``request_id`` is in flight, then
    holds it: the next one, issued behind it, carries the request too."""
    for _ in range(80):
        launches = engine._in_flight.get("decode", [])
        carrying = [la for la in launches if _is_mixed(la.work) and any(
            s.request.request_id == request_id for s in la.work.plan.scheduled)]
        if len(carrying) == 2:
            return carrying
        if len(carrying) != 1 or len(launches) != 1:
            ops.release_all()
        engine.step()
        engine.check_integrity()
    raise AssertionError(f"{request_id} never had two mixed steps in flight")


def _temporal_held(folder):
    engine, ops, side = _held_multiplex(folder, TemporalModel(2))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 30)), params)
    engine.add_request("b", [7 + i % 200 for i in range(400)], params)  # chunk after chunk
    return engine, ops, side


def test_abort_while_two_mixed_steps_are_in_flight(hf_llama):
    """Aborted with two chained mixed steps of it in flight: it ends at once, nothing more is
    emitted, its pages stay taken until both completed, then they are free."""
    engine, ops, side = _temporal_held(hf_llama[0])
    _two_mixed_steps_of(engine, ops, "b")
    request = engine.requests["b"]
    assert request.num_output_tokens == 0 and side.overlapped["b"] > 64, "two prompt chunks"
    _abort_and_drain(engine, ops, side, "b")
    assert _overlap_info(engine)["mixed_steps"]["chained"] > 0
    _assert_clean(engine)


def test_a_chained_mixed_step_is_timed_from_when_the_one_before_it_ended(hf_llama,
                                                                          monkeypatch):
    """A mixed step issued behind another starts on the device when that one ends: what
    calibrates the mixed-step prediction is its own time, not the host's gap before it.
    The host clock is replaced by one the test moves."""
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    engine, ops, side = _temporal_held(hf_llama[0])
    observed = []
    side.model.observe_mixed = (
        lambda predicted, measured, on_graphs=False: observed.append(measured))
    first, second = _two_mixed_steps_of(engine, ops, "b")
    assert first.issued == 0.0 and second.issued == 0.0
    clock["now"] = 4.0  # time passes with both in flight: the first step's, not the second's
    engine.step()
    clock["now"], first.event.left = 10.0, 0
    engine.step()
    assert second.issued == 10.0
    clock["now"], second.event.left = 15.0, 0
    engine.step()
    assert first.work.note.entry.measured_cycle_ms == 10_000.0
    assert second.work.note.entry.measured_cycle_ms == 5_000.0
    assert second.work.note.mixed.as_planned and observed[-2:] == [10_000.0, 5_000.0]


def _prefilled(scheduler: InFlightScheduler, prompt: int):
    """A request whose prompt is computed and whose first token is known."""
    request = make_request(prompt, max_tokens=9)
    scheduler.add(request)
    plan = scheduler.plan_prefill(scheduler.prefill_candidates(), [(0, prompt)])
    scheduler.launched(plan)
    scheduler.complete(plan, StepOutput([20]))
    return request


def _issue_decode(scheduler: InFlightScheduler) -> Work:
    plan = scheduler.plan_decode()
    work = Work(plan, overlapped=True)
    scheduler.launched(plan, overlapped=True)
    scheduler.issued(work)
    return work


def test_prefix_cache_takes_a_block_only_once_its_kv_is_written():
    """Counters advance when a decode is issued; a block must not become a prefix hit
    (read by a prefill on another stream) while the decode writing its last slot runs."""
    scheduler = InFlightScheduler(SchedulerConfig(schedule="multiplex"),
                                  BlockManager(16, 4), 4096)
    request = _prefilled(scheduler, 6)  # 7 known tokens: block 1 ends at position 7
    first, second = _issue_decode(scheduler), _issue_decode(scheduler)
    assert request.num_computed == 8 and request.num_placeholders == 2
    scheduler.complete(first.plan, StepOutput([21]), overlapped=True)
    assert len(request.token_ids) == 8, "block 1 is full of known tokens"
    assert request.num_committed_blocks == 1, "position 7's KV is the second decode's"
    scheduler.complete(second.plan, StepOutput([22]), overlapped=True)
    assert request.num_committed_blocks == 2
    scheduler.blocks.check_integrity(scheduler.live_requests("main"))


def test_a_stop_found_late_keeps_pages_until_the_next_decode_lands():
    scheduler = InFlightScheduler(SchedulerConfig(schedule="multiplex"),
                                  BlockManager(16, 4), 4096)
    request = _prefilled(scheduler, 5)
    request.params.stop_token_ids = [21]
    first, second = _issue_decode(scheduler), _issue_decode(scheduler)
    assert scheduler.complete(first.plan, StepOutput([21]), overlapped=True) == [request]
    assert request.is_finished and request.block_ids and request in scheduler.draining
    scheduler.blocks.check_integrity(scheduler.live_requests("main"))
    assert scheduler.complete(second.plan, StepOutput([30]), overlapped=True) == []
    assert request.token_ids[-1] == 21 and scheduler.overlap.dropped_tokens == 1
    assert not request.block_ids and not scheduler.draining and not scheduler.has_work()
    scheduler.blocks.check_integrity([])


def _issue_chunk(scheduler: InFlightScheduler, candidates, tokens: int) -> Work:
    plan = scheduler.plan_prefill(candidates, [(0, tokens)])
    work = Work(plan, overlapped=True)
    scheduler.launched(plan, overlapped=True)
    scheduler.issued(work)
    return work


def test_a_chunk_follows_its_prompt_on_the_same_stream_and_owes_its_kv():
    """A prompt's next chunk may be issued behind the one still computing it (a chained mixed
    step, same stream), never beside it on the prefill lane; the prefix cache takes none of
    a chunk's blocks until the launch writing them completed."""
    scheduler = InFlightScheduler(SchedulerConfig(schedule="multiplex"),
                                  BlockManager(16, 4), 4096)
    request = make_request(20, max_tokens=9)
    scheduler.add(request)
    first = _issue_chunk(scheduler, scheduler.prefill_candidates(), 8)
    assert request.num_computed == 8 and scheduler.overlapped[request.request_id] == 8
    assert request not in scheduler.prefill_candidates(), "the prefill lane's other stream"
    second = _issue_chunk(scheduler, scheduler.prefill_candidates(same_stream=True), 8)
    assert request.num_computed == 16 and scheduler.overlapped[request.request_id] == 16
    scheduler.complete(first.plan, StepOutput([]), overlapped=True)
    assert request.num_committed_blocks == 2, "positions 8-15 are the second chunk's"
    scheduler.blocks.check_integrity(scheduler.live_requests("main"))
    scheduler.complete(second.plan, StepOutput([]), overlapped=True)
    assert request.num_committed_blocks == 4 and not scheduler.overlapped
    scheduler.blocks.check_integrity(scheduler.live_requests("main"))
