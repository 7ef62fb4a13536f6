"""A batch of prompts on /v1/completions, through the openai client against a real server:
each prompt answered as if sent alone, choices numbered prompt by prompt, usage summed."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import wait_engine_idle

openai = pytest.importorskip("openai")

MODEL = "tiny"
PROMPTS = ["Hi", "Tell me a story"]


def _complete(server, **fields):
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    return server.openai().completions.create(model=MODEL, extra_body=extra, **fields)


def test_each_prompt_of_a_batch_gets_its_own_choices_as_if_sent_alone(server):
    fields = {"max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2}
    batch = _complete(server, prompt=PROMPTS, **fields)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = [_complete(server, prompt=p, **fields) for p in PROMPTS]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * 6
    assert batch.id.startswith("cmpl-") and len({c.text for c in batch.choices}) > 1


def test_a_batch_of_token_id_prompts_echoes_each_prompt(server):
    batch = _complete(server, prompt=[[72, 105], [65, 66, 67]], max_tokens=3, temperature=0,
                      echo=True)
    assert batch.choices[0].text.startswith("Hi") and batch.choices[1].text.startswith("ABC")
    assert batch.usage.prompt_tokens == 5  # token ids are taken as sent: no BOS added


def test_a_streamed_batch_carries_each_prompts_chunks_under_its_index(server):
    fields = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    whole = _complete(server, **fields)
    chunks = list(_complete(server, stream=True, stream_options={"include_usage": True},
                            **fields))
    text = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.text
    assert text == {c.index: c.text for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_best_of_picks_within_each_prompt(server):
    fields = {"max_tokens": 5, "temperature": 1.0, "seed": 7, "best_of": 3}
    batch = _complete(server, prompt=PROMPTS, **fields)
    alone = [_complete(server, prompt=p, **fields).choices[0].text for p in PROMPTS]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.completion_tokens == 2 * 3 * 5


def test_a_batch_with_one_prompt_too_long_is_refused_before_any_starts(server):
    before = wait_engine_idle(server)
    status, _, raw = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": ["Hi", [65] * 100_000], "max_tokens": 4})
    error = json.loads(raw)["error"]
    assert status == 400 and "context" in error["message"], raw
    after = wait_engine_idle(server)  # "Hi" never reached the engine's prefix cache
    assert after["pdserve_prefix_cache_queries_total"] \
        == before["pdserve_prefix_cache_queries_total"]


def test_an_evaluation_harness_loglikelihood_batch_scores_each_prompt(server):
    # What lm-evaluation-harness's local-completions sends to score continuations: token
    # ids, echo, one logprob, one new token, greedy.
    prompts = [[1, 72, 105, 32, 116, 104, 101, 114, 101], [1, 65, 66, 67]]
    fields = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    batch = _complete(server, prompt=prompts, **fields)
    alone = [_complete(server, prompt=p, **fields).choices[0] for p in prompts]
    for got, want, prompt in zip(batch.choices, alone, prompts, strict=True):
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs)
        assert len(got.logprobs.tokens) == len(prompt) + 1 and got.text == want.text
        assert got.logprobs.token_logprobs[0] is None  # nothing predicts the first token
