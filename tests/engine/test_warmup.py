"""The start-up warm-up of eager steps leaves the engine as it found it."""

from __future__ import annotations

import pytest

from pdserve.engine.llm import LLM
from pdserve.engine.warmup import SHAPES, run_shapes, skip_reason
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(40 + 9 * i)] for i in range(4)]


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("schedule", ["chunked", "multiplex"])
def test_warm_up_runs_every_shape_and_gives_everything_back(schedule):
    options = dict(device="cpu", schedule=schedule, chunk_size=64, max_num_batched_tokens=64,
                   mux_predictor="roofline")
    expected = _tokens(LLM("tiny", **options))
    llm = LLM("tiny", **options)
    engine = llm.engine
    free = engine.blocks.num_free_blocks
    ran = run_shapes(engine, tokens=33)  # 33 + 1 or 3 decode rows: no multiple of 16
    assert ran["steps"] == len(SHAPES) and ran["prompt_tokens"] == 33
    assert engine.blocks.num_free_blocks == free and not engine.requests
    assert not engine.runner.tables._rows  # no block-table row left behind
    if schedule == "multiplex":
        assert engine.timeline() == []  # the planner never saw them
    assert _tokens(llm) == expected


def test_where_it_does_not_run_it_says_why():
    assert "device" in skip_reason(LLM("tiny", device="cpu").engine)
    disagg = LLM("tiny", device="cpu", schedule="disagg", allow_emulated_partitions=True)
    disagg.engine.runner.device = type("D", (), {"type": "cuda"})()  # past the device check
    assert "no whole-GPU steps" in skip_reason(disagg.engine)
