"""The step timeline of the whole-GPU policies: each step's shape as planned and its time."""

from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.sched.base import Plan, StepOutput, Work
from pdserve.sched.steps import StepTimeline, step_entry

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _request(name: str, prompt: int, computed: int, generated: int = 0) -> Request:
    request = Request(name, list(range(1, prompt + 1)), GREEDY)
    request.token_ids.extend([7] * generated)
    request.num_computed = computed
    return request


def test_an_entry_keeps_the_step_as_planned():
    plan = Plan()
    plan.add(_request("a", 100, 100, generated=1), 1)  # decodes over 101 tokens
    plan.add(_request("b", 40, 40, generated=3), 1)
    plan.add(_request("c", 300, 256), 44)  # the end of a prompt after 256 cached
    plan.add(_request("d", 90, 0), 60)  # the start of another
    entry = step_entry(plan, now=5.0)
    assert (entry.time, entry.mode, entry.decode_batch) == (5.0, "mixed", 2)
    assert entry.decode_context_tokens == 101 + 43
    assert entry.prefill_pieces == [[256, 44], [0, 60]]
    assert (entry.prefill_tokens, entry.prefill_context_tokens) == (104, 256)
    last = Plan()
    last.add(_request("a", 100, 100, generated=1), 1)
    last.add(_request("e", 50, 49), 1)  # a chunk that left a prompt's last token alone
    entry = step_entry(last)
    assert (entry.decode_batch, entry.decode_context_tokens) == (1, 101)
    assert (entry.mode, entry.prefill_pieces) == ("mixed", [[49, 1]])
    alone = Plan()
    alone.add(_request("d", 90, 0), 90)
    assert step_entry(alone).mode == "prefill_only"
    decodes = Plan()
    decodes.add(_request("a", 10, 10, generated=1), 1)
    assert step_entry(decodes).mode == "decode_only"
    assert step_entry(decodes).prefill_pieces == []


def test_a_completed_step_gets_its_path_and_both_times():
    timeline = StepTimeline(length=2)
    plans = [Plan() for _ in range(3)]
    for plan in plans:
        plan.add(_request("a", 10, 10, generated=1), 1)
    works = [Work(p, note=timeline.planned(p), path="decode_graph") for p in plans]
    StepTimeline.completed(works[2], StepOutput([1], elapsed_ms=21.5, device_ms=19.0))
    StepTimeline.completed(works[1], StepOutput([1], elapsed_ms=3.0))  # no device clock
    entries = timeline.entries()
    assert len(entries) == 2  # the oldest dropped
    assert [(e["measured_cycle_ms"], e["measured_device_ms"]) for e in entries] == [
        (3.0, 0.0), (21.5, 19.0)]
    assert {e["path"] for e in entries} == {"decode_graph"}
    assert timeline.entries(since=entries[1]["time"]) == entries[1:]
    StepTimeline.completed(Work(plans[0], note="not an entry"), StepOutput([1]))  # ignored


PROMPTS = [list(range(3, 100)), list(range(5, 40)), list(range(9, 20))]


@pytest.mark.parametrize("schedule", ["chunked", "prefill-first"])
def test_a_served_run_accounts_for_every_token_in_its_steps(schedule):
    """Every prompt token is in one piece, every later token in one decode; the pieces of
    one prompt follow each other (each starts where its prompt's last ended); on the CPU
    every step ran eagerly and only the host timed it."""
    llm = LLM("tiny", device="cpu", schedule=schedule, chunk_size=64,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    steps = llm.engine.timeline()
    assert sum(e["prefill_tokens"] for e in steps) == sum(map(len, PROMPTS))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert sum(e["decode_batch"] for e in steps) == generated - len(PROMPTS)
    starts = sorted(done for e in steps for done, _ in e["prefill_pieces"])
    ends = sorted(done + n for e in steps for done, n in e["prefill_pieces"])
    assert starts.count(0) == len(PROMPTS)
    assert sorted(s for s in starts if s) == sorted(e for e in ends if e not in map(len, PROMPTS))
    for entry in steps:
        assert entry["prefill_tokens"] == sum(n for _, n in entry["prefill_pieces"])
        assert entry["prefill_context_tokens"] == sum(d for d, _ in entry["prefill_pieces"])
        assert entry["prefill_tokens"] + entry["decode_batch"] <= 64
        assert entry["path"] == "eager" and entry["measured_device_ms"] == 0.0
        assert entry["measured_cycle_ms"] > 0
    if schedule == "prefill-first":  # decodes wait while any prompt work is left
        assert "mixed" not in {e["mode"] for e in steps}
    else:
        assert {e["mode"] for e in steps} == {"prefill_only", "mixed", "decode_only"}


def test_a_multiplex_timeline_keeps_its_whole_gpu_steps_shapes():
    """Mixed steps (temporal) record their decodes' KV tokens and their prompt pieces,
    decode-only decisions their decodes' KV tokens; the step check reads those two kinds
    as the chunked engine's steps and leaves the rest out."""
    from pdserve.sim.cluster import LatencyModel
    from pdserve.sim.step_check import step_check, whole_gpu_steps

    llm = LLM("tiny", device="cpu", schedule="multiplex", mux_predictor="roofline",
              max_num_batched_tokens=64, mux_sharing="temporal")
    prompts = [list(range(3, 20)), list(range(3, 200))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    decisions = llm.engine.timeline()
    mixed = [e for e in decisions if e["mode"] == "temporal"]
    assert mixed and all(sum(n for _, n in e["prefill_pieces"]) == e["prefill_tokens"]
                         for e in mixed)
    assert mixed[0]["decode_context_tokens"] == len(prompts[0]) + 1  # its one decode
    assert all(e["path"] == "eager" for e in mixed)
    alone = [e for e in decisions if e["mode"] == "decode_only"]
    assert alone and all(e["decode_context_tokens"] > 0 and not e["prefill_pieces"]
                         for e in alone)
    steps = whole_gpu_steps(decisions)
    assert len(steps) == len(mixed) + len(alone)
    assert {e["mode"] for e in steps} == {"mixed", "decode_only"}
    model = LatencyModel(prefill_per_token_s=1e-5, prefill_per_token_sq_s=0.0,
                         decode_base_s=1e-3, decode_per_request_s=1e-4,
                         decode_per_kv_token_s=1e-7, kv_bytes_per_token=4096)
    check = step_check(model, 0.0, decisions)
    assert check["steps"] == len(steps) and check["clock"] == "host"
    # a timeline from before the shapes were recorded gives the check nothing
    older = [{k: v for k, v in e.items() if k != "decode_context_tokens"} for e in decisions]
    assert whole_gpu_steps(older) == []
