"""``LLM.beam_search``, the offline beam search as vLLM's."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.beam_search import BeamSearchParams


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny") as engine:
        yield engine


def test_a_beam_of_one_is_greedy_decoding(llm):
    (out,) = llm.beam_search("Once upon", BeamSearchParams(1, 7, ignore_eos=True))
    (greedy,) = llm.generate("Once upon", SamplingParams(max_tokens=7, temperature=0,
                                                         ignore_eos=True))
    (best,) = out.sequences
    assert best.token_ids == greedy.outputs[0].token_ids and best.text == greedy.outputs[0].text
    assert best.finish_reason == "length"


def test_wider_beams_come_best_first(llm):
    outs = llm.beam_search(["Once upon", {"prompt_token_ids": [256, 65, 66]}],
                           BeamSearchParams(3, 5, ignore_eos=True, length_penalty=0.0))
    for out in outs:
        sums = [s.cum_logprob for s in out.sequences]
        assert len(sums) == 3 and sums == sorted(sums, reverse=True)
        assert len({tuple(s.token_ids) for s in out.sequences}) == 3


def test_a_beam_width_past_ten_is_refused():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(11, 4)
