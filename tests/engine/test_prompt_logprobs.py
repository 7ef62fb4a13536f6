"""Prompt logprobs: every prompt position scored in the prefill steps that run it, equal to
transformers' log-softmax over the prompt, under every schedule that prefills locally."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.launch import PROMPT_SCORE_ROWS, PromptRows
from pdserve.request import Request

TOP = 3


def _oracle(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logprobs at each prompt position, float32: row i predicts token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def _check_against(oracle: torch.Tensor, prompt: list[int], got) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row, token = oracle[i - 1], prompt[i]
        position = got[i]
        want_rank = int((row > row[token]).sum()) + 1
        assert position[token].rank == want_rank
        assert abs(position[token].logprob - row[token].item()) < 1e-4
        top = row.topk(TOP)
        for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                           strict=True), start=1):
            assert position[t].rank == rank
            assert abs(position[t].logprob - lp) < 1e-4
        assert set(position) == set(top.indices.tolist()) | {token}


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (23, 9, 41)]


CONFIGS = {
    "prefill-first": dict(schedule="prefill-first"),
    "chunked-7": dict(schedule="chunked", chunk_size=7),  # every prompt spans several chunks
    "chunked-7-synchronous": dict(schedule="chunked", chunk_size=7, overlap_schedule=False),
    # 8 blocks of 8 tokens cannot hold the four requests at once: some are preempted and
    # their prompts scored again from the start.
    "chunked-preempting": dict(schedule="chunked", chunk_size=8, num_blocks=8, block_size=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_equal_transformers(hf_llama, name):
    folder, model = hf_llama
    prompts = _prompts()
    llm = LLM(folder, dtype="float32", **CONFIGS[name])
    scored = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # A request that asks nothing rides in the same steps and gets nothing.
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids":
                           prompts[0]}], [scored] * len(prompts) + [plain])
    for prompt, out in zip(prompts, outputs, strict=False):
        _check_against(_oracle(model, prompt), prompt, out.prompt_logprobs)
    assert outputs[-1].prompt_logprobs is None
    assert outputs[-1].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    llm.engine.check_integrity()
    overlap = llm.engine.describe()["overlap_schedule"]
    assert (overlap["overlapped_steps"] > 0) == (name != "chunked-7-synchronous")
    if name == "chunked-preempting":
        assert llm.engine.stats().num_preemptions > 0


def test_zero_alternatives_give_the_prompt_token_alone(hf_llama):
    folder, model = hf_llama
    prompt = _prompts()[1]
    llm = LLM(folder, dtype="float32")
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    oracle = _oracle(model, prompt)
    for i in range(1, len(prompt)):
        assert list(out.prompt_logprobs[i]) == [prompt[i]]
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - oracle[i - 1, prompt[i]]) < 1e-4


def test_scoring_request_takes_no_prefix_hit_while_others_do(hf_llama):
    folder, model = hf_llama
    prompt = list(range(3, 60))
    llm = LLM(folder, dtype="float32", block_size=8)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params)  # publishes the prefix
    scored = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0
    oracle = _oracle(model, prompt)
    assert abs(scored.prompt_logprobs[-1][prompt[-1]].logprob
               - oracle[-2, prompt[-1]].item()) < 1e-4
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert again.num_cached_tokens == 56  # 7 full blocks still hit for a plain request


@pytest.mark.parametrize("schedule", ["multiplex", "disagg"])
def test_prompt_logprobs_under_split_schedules(hf_llama, schedule):
    folder, model = hf_llama
    prompts = _prompts()
    llm = LLM(folder, dtype="float32", schedule=schedule, chunk_size=16,
              max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        _check_against(_oracle(model, prompt), prompt, out.prompt_logprobs)


@pytest.mark.parametrize("value", [21, -1, 2.5, True])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_scoring_count_drops_when_a_request_ends_or_is_aborted(hf_llama):
    # While the count is zero a step skips prompt scoring without looking at its batch.
    folder, _ = hf_llama
    llm = LLM(folder, dtype="float32")
    before = Request.num_scoring
    llm.engine.add_request("gone", [3, 4, 5, 6], SamplingParams(prompt_logprobs=1))
    assert Request.num_scoring == before + 1
    llm.engine.abort_request("gone")
    assert Request.num_scoring == before
    assert [u.finish_reason for u in llm.engine.step()] == ["abort"]
    llm.generate({"prompt_token_ids": [3, 4, 5, 6]}, SamplingParams(max_tokens=2,
                                                                     prompt_logprobs=1))
    assert Request.num_scoring == before


def test_memory_profile_scores_one_full_pass(hf_llama):
    # What the KV budget reserves for: one pass of the most positions, 20 alternatives each.
    folder, _ = hf_llama
    model = LLM(folder, dtype="float32").engine.runner.model
    rows = PromptRows.worst_case(300, torch.device("cpu"))
    rows.score(model, torch.randn(300, 64))
    assert rows.host.shape == (PROMPT_SCORE_ROWS, 2 + 2 * 20)
    ranks = rows.host[:, 1]
    assert bool((ranks >= 1).all()) and bool((ranks <= 300).all())  # vocab of 300
