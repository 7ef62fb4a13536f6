"""The sampling fields a vLLM user expects, through the openai client against a real server:
penalties, logit_bias, min_p, top alternatives, n and best_of (seeds, streaming, usage, the
prefix cache shared by the choices)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import wait_engine_idle

openai = pytest.importorskip("openai")

MODEL = "tiny"
USER = [{"role": "user", "content": "Tell me"}]
A = "65"  # the byte tokenizer's id of "A"


def _complete(server, **fields):
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    return server.openai().completions.create(model=MODEL, prompt=fields.pop("prompt", "Hi"),
                                              extra_body=extra, **fields)


def test_logit_bias_and_frequency_penalty_steer_greedy_decoding(server):
    biased = _complete(server, max_tokens=8, temperature=0, logit_bias={A: 10})
    assert biased.choices[0].text == "A" * 8
    # Each "A" costs 2: after about five of them the bias of 10 no longer carries it.
    penalized = _complete(server, max_tokens=8, temperature=0, logit_bias={A: 10},
                          frequency_penalty=2.0)
    assert 3 <= penalized.choices[0].text.count("A") <= 6
    banned = _complete(server, max_tokens=8, temperature=0, logit_bias={A: -100})
    assert "A" not in banned.choices[0].text


def test_allowed_token_ids_leave_only_their_tokens_on_both_endpoints(server):
    sampled = _complete(server, max_tokens=24, temperature=1.0, seed=3,
                        extra_body={"allowed_token_ids": [65, 66]})
    assert set(sampled.choices[0].text) <= {"A", "B"} and len(sampled.choices[0].text) == 24
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0,
        extra_body={"allowed_token_ids": [67], "ignore_eos": True})
    assert chat.choices[0].message.content == "C" * 6


def test_bad_words_are_never_generated(server):
    free = _complete(server, max_tokens=12, temperature=0, logit_bias={A: 10})
    assert "AA" in free.choices[0].text
    held = _complete(server, max_tokens=12, temperature=0, logit_bias={A: 10},
                     extra_body={"bad_words": ["AA", "B"]})
    text = held.choices[0].text
    assert "AA" not in text and "B" not in text and text.count("A") >= 5, text
    info = json.loads(server.request("GET", "/v1/engine/info")[2])
    assert info["overlap_schedule"]["synchronous_steps"]["bad_words"] >= 11, info


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": USER})):
        status, _, raw = server.request("POST", path, {
            "model": MODEL, "max_tokens": 12, "ignore_eos": True, "stream": True, **body,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        assert status == 200 and all(e["usage"] is not None for e in events), raw
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 2, counts
        prompt = {e["usage"]["prompt_tokens"] for e in events}
        assert len(prompt) == 1 and events[-1]["choices"] == []  # the last: usage alone


def test_continuous_usage_counts_each_choice_and_the_last_chunk_sums_them(server):
    status, _, raw = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": 6, "ignore_eos": True, "n": 2,
        "seed": 1, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    per_choice: dict[int, list[int]] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        per_choice.setdefault(choice["index"], []).append(event["usage"]["completion_tokens"])
    assert status == 200 and sorted(per_choice) == [0, 1], raw
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[-1] == 6
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_truncate_prompt_tokens_keeps_the_prompts_end(server):
    kept = _complete(server, prompt="Hello world", max_tokens=6, temperature=0, echo=True,
                     extra_body={"truncate_prompt_tokens": 3})
    assert kept.usage.prompt_tokens == 3 and kept.choices[0].text.startswith("rld")
    # the same answer as the last three tokens sent alone (no BOS: it was cut with the rest)
    alone = _complete(server, prompt="rld", max_tokens=6, temperature=0,
                      extra_body={"add_special_tokens": False})
    assert kept.choices[0].text == "rld" + alone.choices[0].text
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    whole = _complete(server, prompt="Hi", max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 3  # BOS + "Hi": shorter than the context, kept whole


def test_min_p_one_keeps_only_the_greedy_token(server):
    greedy = _complete(server, max_tokens=8, temperature=0)
    sampled = _complete(server, max_tokens=8, temperature=1.5, seed=3,
                        extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == greedy.choices[0].text


def test_penalties_are_accepted_on_chat_and_change_nothing_at_their_off_values(server):
    client = server.openai()
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6,
                                           temperature=0)
    off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6,
                                         temperature=0, presence_penalty=0.0,
                                         frequency_penalty=0.0,
                                         extra_body={"repetition_penalty": 1.0, "min_p": 0.0})
    assert off.choices[0].message.content == plain.choices[0].message.content
    on = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6,
                                        temperature=0, presence_penalty=1.5,
                                        extra_body={"repetition_penalty": 1.3})
    assert on.choices[0].finish_reason == "length"


def test_chat_top_logprobs_in_openais_shape(server):
    out = server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=5, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy takes the most likely
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)


def test_completions_logprobs_n_lists_the_alternatives_and_the_sampled_token(server):
    out = _complete(server, max_tokens=5, temperature=1.0, seed=11, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Three alternatives and the sampled token with its own logprob (fewer keys when
        # byte tokens decode to the same text).
        assert 1 <= len(top) <= 4 and top[token] == pytest.approx(value)


def test_n_choices_use_seed_plus_index_and_sum_their_usage(server):
    out = _complete(server, max_tokens=6, temperature=1.0, seed=10, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [_complete(server, max_tokens=6, temperature=1.0, seed=10 + i).choices[0].text
             for i in range(3)]
    assert [c.text for c in out.choices] == alone
    assert out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens == len(b"Hi") + 1  # BOS + bytes, counted once


def test_chat_n_streams_every_choice_with_its_index(server):
    chunks = list(server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=1.0, seed=4, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    finished = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1} and chunks[-1].usage.completion_tokens == 10
    whole = server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=1.0, seed=4, n=2,
        extra_body={"ignore_eos": True})
    assert text == {c.index: c.message.content for c in whole.choices}


def test_best_of_returns_the_choice_with_the_highest_logprob_sum(server):
    fields = {"max_tokens": 5, "temperature": 1.0}
    sums = {}
    for seed in (7, 8, 9):
        lp = _complete(server, seed=seed, logprobs=0, **fields).choices[0]
        sums[lp.text] = sum(lp.logprobs.token_logprobs)
    best = _complete(server, seed=7, best_of=3, **fields)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == max(sums, key=sums.get)
    assert best.usage.completion_tokens == 15  # every generated token is billed


def test_choices_after_the_first_take_the_prompt_from_the_prefix_cache(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # 361 tokens with BOS
    before = wait_engine_idle(server)
    _complete(server, prompt=prompt, max_tokens=3, temperature=1.0, n=3)
    after = wait_engine_idle(server)
    full_pages = (len(prompt) + 1) // 16 * 16  # pages of 16 tokens
    hits = after["pdserve_prefix_cache_hits_total"] - before["pdserve_prefix_cache_hits_total"]
    queries = after["pdserve_prefix_cache_queries_total"] \
        - before["pdserve_prefix_cache_queries_total"]
    assert queries == 3 * (len(prompt) + 1)
    assert hits >= 2 * full_pages  # choices 2 and 3 computed at most the last partial page


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "n": 65}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "bad_words": "x"}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, "priority"),  # FCFS server
    ("/v1/completions", {"prompt": "x", "stream": True,  # without include_usage
                         "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": USER, "stream": True,
                              "stream_options": {"include_usge": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": USER, "priority": "high"}, "priority"),
    ("/v1/completions", {"prompt": "x", "bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["a"], "allowed_token_ids": [97]},
     "bad_words"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 10**6},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [100000]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [65], "guided_regex": "a+"},
     "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
])
def test_out_of_range_values_are_400_naming_the_field(server, path, body, param):
    status, _, raw = server.request("POST", path, {"model": MODEL, "max_tokens": 1, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, raw


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(server):
    fields = {"max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True,
              "prompt": "Hi"}
    by_text = _complete(server, **fields).choices[0]
    by_id = _complete(server, extra_body={"return_tokens_as_token_ids": True},
                      **fields).choices[0]
    assert by_id.text == by_text.text
    lp, texts = by_id.logprobs, by_text.logprobs
    assert lp.tokens[1:3] == ["token_id:72", "token_id:105"]  # the prompt's "H", "i"
    # The byte tokenizer's ids are bytes: the ids give back the text exactly, where the
    # pieces of a multi-byte character each read "\ufffd" as texts.
    ids = bytes(int(t.split(":")[1]) for t in lp.tokens[1:])
    assert ids.decode(errors="replace") == by_id.text
    assert lp.token_logprobs == texts.token_logprobs
    for top in lp.top_logprobs[1:]:
        assert all(key.startswith("token_id:") for key in top) and len(top) >= 2
    chat = server.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:")
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)
