"""Every policy through the one engine loop, under the same pressure: shared prefixes (prefix
caching), a pool too small for every request at once (preemption) and an abort part-way.
The tokens of the requests not aborted equal one unpressured, synchronous chunked engine's,
and the block managers' integrity check holds after every step. The one-lane policies run
with overlap scheduling (their default) and chunked once more without."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams

SCHEDULES = ("prefill-first", "chunked", "multiplex", "disagg")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
OPTIONS = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64, "chunk_size": 48}


def _prompts(count: int = 8, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(32)]  # a common prefix for cache hits
    return [(shared if i % 2 else []) + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 60))]
            for i in range(count)]


@pytest.fixture(scope="module")
def reference():
    prompts = _prompts()
    llm = LLM("tiny", overlap_schedule=False, **OPTIONS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return prompts, [o.outputs[0].token_ids for o in outputs]


def _drive(engine, prompts, victim: str, abort_at: int) -> tuple[dict, dict]:
    tokens = {f"q{i}": [] for i in range(len(prompts))}
    finish = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, GREEDY)
    for step in range(3000):
        if not engine.has_work():
            return tokens, finish
        if step == abort_at:
            engine.abort_request(victim)
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
            if update.finished:
                finish[update.request_id] = update.finish_reason
        engine.check_integrity()
    raise AssertionError("did not finish")


@pytest.mark.parametrize(("schedule", "overlap"),
                         [(s, True) for s in SCHEDULES] + [("chunked", False)])
def test_prefix_hits_preemption_and_abort_under_every_policy(reference, schedule, overlap):
    prompts, want = reference
    # 16 pages of 8 tokens cannot hold 8 requests of up to 100 tokens at once; disagg
    # splits its pages in two, so it gets enough for its larger pool to hold any one.
    num_blocks = 48 if schedule == "disagg" else 16
    llm = LLM("tiny", schedule=schedule, num_blocks=num_blocks, overlap_schedule=overlap,
              disagg_prefill_kv_fraction=0.5, **OPTIONS)
    engine = llm.engine
    tokens, finish = _drive(engine, prompts, victim="q3", abort_at=6)
    assert finish["q3"] in ("abort", "length")
    assert tokens["q3"] == want[3][: len(tokens["q3"])]
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert tokens[f"q{i}"] == want[i], f"q{i} under {schedule}"
        assert finish[f"q{i}"] == "length"
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_total_blocks and not engine.requests
    if schedule != "disagg":  # its decode pool has no prefix cache to keep pages in use
        assert stats.num_preemptions > 0, "the pool was meant to be too small"
    overlapped = engine.describe()["overlap_schedule"]["overlapped_steps"]
    assert (overlapped > 0) == overlap
