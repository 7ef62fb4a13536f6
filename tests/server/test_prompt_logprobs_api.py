"""prompt_logprobs (both endpoints) and echo with logprobs (completions), through a real
server and the official openai client, shaped as vLLM's OpenAI server answers them."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny"
PROMPT = "Score me"
K = 2


def _check_positions(prompt_logprobs: list, width: int) -> list[int]:
    """Each position after the first: the prompt token plus the ``width`` best, ranks right.
    Returns the prompt token ids read from it (the one entry that may rank past ``width``)."""
    assert prompt_logprobs[0] is None
    ids = []
    for position in prompt_logprobs[1:]:
        ranks = sorted(entry["rank"] for entry in position.values())
        assert ranks[:width] == list(range(1, width + 1))
        assert len(position) in (width, width + 1)
        best = min(position.values(), key=lambda e: e["rank"])
        assert all(e["logprob"] <= best["logprob"] <= 0 for e in position.values())
        assert all(isinstance(e["decoded_token"], str) for e in position.values())
        ids.append([int(t) for t in position])
    return ids


def _prompt_ids(server, prompt: str) -> list[int]:
    status, _, raw = server.request("POST", "/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200
    return json.loads(raw)["tokens"]


def test_completions_prompt_logprobs(server):
    client = server.openai()
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                       extra_body={"prompt_logprobs": K})
    choice = answer.model_dump()["choices"][0]
    prompt_ids = _prompt_ids(server, PROMPT)
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt_ids)
    for token, ids in zip(prompt_ids[1:], _check_positions(scored, K), strict=True):
        assert token in ids
    assert choice["logprobs"] is None  # not asked for


def test_chat_prompt_logprobs_per_response(server):
    client = server.openai()
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0}).model_dump()
    scored = answer["prompt_logprobs"]  # vLLM puts it beside "choices"
    assert answer["usage"]["prompt_tokens"] == len(scored)
    assert all(len(p) == 1 for p in scored[1:])  # 0 alternatives: the prompt token alone
    assert "prompt_logprobs" not in answer["choices"][0]


def test_prompt_logprobs_zero_holds_the_prompt_tokens(server):
    answer = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                                extra_body={"prompt_logprobs": 0})
    scored = answer.model_dump()["choices"][0]["prompt_logprobs"]
    assert [int(t) for p in scored[1:] for t in p] == _prompt_ids(server, PROMPT)[1:]


def test_echo_with_logprobs_puts_the_prompt_tokens_first(server):
    client = server.openai()
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": K,
              "temperature": 0}
    echoed = client.completions.create(echo=True, extra_body={"prompt_logprobs": K}, **kwargs)
    plain = client.completions.create(**kwargs)
    choice, alone = echoed.choices[0], plain.choices[0]
    num_prompt = len(_prompt_ids(server, PROMPT))
    logprobs = choice.logprobs
    assert choice.text == PROMPT + alone.text
    assert len(logprobs.tokens) == num_prompt + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[num_prompt:] == alone.logprobs.tokens
    # The plain request may take prefix-cache hits, the echoed one not: rounding may differ.
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(alone.logprobs.token_logprobs,
                                                                 abs=1e-4)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[num_prompt] == len("".join(logprobs.tokens[:num_prompt]))
    # The echoed tokens' logprobs are the prompt logprobs of the same request.
    scored = echoed.model_dump()["choices"][0]["prompt_logprobs"]
    ids = _prompt_ids(server, PROMPT)
    for i in range(1, num_prompt):
        assert logprobs.token_logprobs[i] == scored[i][str(ids[i])]["logprob"]
        assert len(logprobs.top_logprobs[i]) in (K, K + 1)


def test_echo_with_logprobs_streams_the_prompt_tokens_in_the_first_chunk(server):
    # ignore_eos: sampled, the random model's first token is its EOS about once in 300
    # requests, and the answer then ends one token short
    chunks = list(server.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1, echo=True, stream=True,
        extra_body={"ignore_eos": True}))
    num_prompt = len(_prompt_ids(server, PROMPT))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) >= num_prompt
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == num_prompt + 2


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                                   {"prompt_logprobs": "2"},
                                   {"prompt_logprobs": 1, "stream": True}])
def test_bad_prompt_logprobs_get_a_400_naming_the_field(server, endpoint, body, extra):
    status, _, raw = server.request("POST", endpoint,
                                    {"model": MODEL, "max_tokens": 1, **body, **extra})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "prompt_logprobs", raw
    assert "prompt_logprobs" in error["message"]


def test_every_choice_carries_the_prompt_scores(server):
    # best_of ranks the choices by their generated tokens only: the echoed first token has no
    # logprob (None), which the ranking must skip.
    answer = server.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, n=2, best_of=3, seed=5, logprobs=1,
        echo=True, extra_body={"prompt_logprobs": 0}).model_dump()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    first, second = (c["prompt_logprobs"] for c in choices)
    assert first[0] is None and second[0] is None
    for a, b in zip(first[1:], second[1:], strict=True):  # batched apart: float rounding
        assert a.keys() == b.keys()
        assert all(a[t]["logprob"] == pytest.approx(b[t]["logprob"], abs=1e-4) for t in a)
    for choice in choices:
        assert choice["text"].startswith(PROMPT)
        assert choice["logprobs"]["token_logprobs"][0] is None
