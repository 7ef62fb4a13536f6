"""``LLM.reset_prefix_cache``: a prompt generated again after the reset takes no cached
tokens, and its greedy answer is unchanged (the forgotten blocks were only forgotten)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

PROMPT = list(range(5, 5 + 70))  # several 16-token blocks


@pytest.mark.parametrize("schedule", ["chunked", "multiplex"])
def test_a_reset_prompt_is_computed_again_to_the_same_answer(schedule):
    options = {"mux_predictor": "roofline"} if schedule == "multiplex" else {}
    with LLM("tiny", device="cpu", schedule=schedule, **options) as llm:
        params = SamplingParams(temperature=0, max_tokens=4)
        first = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        cached = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        assert cached.num_cached_tokens > 0
        counts = llm.reset_prefix_cache()
        assert counts["forgotten_blocks"] > 0 and counts["cached_blocks_in_use"] == 0
        again = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        assert again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
