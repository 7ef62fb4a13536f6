"""Beam search (``use_beam_search``): the search against every sequence scored by hand,
and through a real server."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import pytest

from pdserve.beam_search import Beam, beam_search

# A toy model over tokens 0, 1 and EOS (2): the next token's logprobs given the last one.
TABLE = {None: [0.5, 0.3, 0.2], 0: [0.1, 0.6, 0.3], 1: [0.7, 0.1, 0.2]}
EOS = 2


async def _toy_next(beams: list[list[int]]) -> list[list[tuple[int, float]]]:
    return [sorted(((t, math.log(p)) for t, p in enumerate(TABLE[b[-1] if b else None])),
                   key=lambda x: -x[1]) for b in beams]


def _every_sequence(max_tokens: int) -> list[Beam]:
    """Every way to go on from the prompt: ended by EOS at any step, or max_tokens long."""
    found = []
    for length in range(1, max_tokens + 1):
        for tokens in itertools.product((0, 1, EOS), repeat=length):
            if EOS in tokens[:-1] or (length < max_tokens and tokens[-1] != EOS):
                continue
            last, logprob = None, 0.0
            for token in tokens:
                logprob += math.log(TABLE[last][token])
                last = token
            found.append(Beam(list(tokens), logprob, tokens[-1] == EOS))
    return found


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_a_beam_as_wide_as_every_sequence_finds_the_best_ones(length_penalty):
    prompt_len = 5
    every = _every_sequence(3)
    score = lambda b: b.logprob / (prompt_len + len(b.tokens) - b.finished) ** length_penalty  # noqa: E731
    want = sorted(every, key=score, reverse=True)[:4]
    got = asyncio.run(beam_search(_toy_next, 8, 3, {EOS}, False, length_penalty, prompt_len))
    assert [b.tokens for b in got[:4]] == [b.tokens for b in want]
    assert [b.logprob for b in got[:4]] == pytest.approx([b.logprob for b in want])


def test_a_beam_of_one_is_greedy_and_ignore_eos_keeps_going():
    (greedy,) = asyncio.run(beam_search(_toy_next, 1, 4, {EOS}, True, 1.0, 1))
    assert greedy.tokens == [0, 1, 0, 1] and not greedy.finished


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = server.request("POST", path, {"model": "tiny", **body})
    return status, json.loads(raw)


def test_a_beam_of_one_through_the_server_is_greedy_decoding(server):
    fields = {"prompt": "Once upon", "max_tokens": 8, "ignore_eos": True}
    status, beam = _post(server, "/v1/completions", {**fields, "use_beam_search": True})
    _, greedy = _post(server, "/v1/completions", {**fields, "temperature": 0})
    assert status == 200, beam
    assert beam["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert beam["usage"]["completion_tokens"] == 8


def test_beams_answer_as_choices_best_first_on_both_endpoints(server):
    fields = {"max_tokens": 5, "ignore_eos": True, "use_beam_search": True, "n": 2,
              "best_of": 4, "length_penalty": 0.5}
    status, answer = _post(server, "/v1/completions", {**fields, "prompt": "Hi"})
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1], answer
    texts = [c["text"] for c in answer["choices"]]
    assert texts[0] != texts[1] and all(c["finish_reason"] == "length"
                                        for c in answer["choices"])
    chat_fields = {k: v for k, v in fields.items() if k != "best_of"}
    status, chat = _post(server, "/v1/chat/completions",
                         {**chat_fields, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and len(chat["choices"]) == 2, chat
    assert chat["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"stream": True}, "stream"),
    ({"logprobs": 0}, "logprobs"),
    ({"stop": ["x"]}, "stop"),
    ({"seed": 3}, "seed"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"n": 11}, "n"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_what_a_beam_search_cannot_honour_is_a_400_naming_it(server, extra, param):
    status, answer = _post(server, "/v1/completions", {
        "prompt": "Hi", "max_tokens": 3, "use_beam_search": True, **extra})
    assert status == 400 and answer["error"]["param"] == param, answer
