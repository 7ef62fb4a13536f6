"""Structured output and tool calls through the official ``openai`` client against a real
server on the tiny model: every sampled output parses and matches its schema, regex, choice
or grammar; tool calls' arguments parse against their function's parameters."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest

from tests.server.conftest import start_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SAMPLES = 20  # seeded choices per kind (choice i samples with seed + i)
CHAT = [{"role": "user", "content": "Fill it in."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 4},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["a", "b", "c"]}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12,
                                                               "maximum": 14}}}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
LLAMA3_CALL = '{"name": "get_time", "parameters": {"zone": 2}}'


@pytest.fixture(scope="module")
def hermes():
    srv = start_server("--max-num-seqs", "64", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def _chat(server, **kwargs):
    return server.openai().chat.completions.create(model="tiny", messages=CHAT, seed=7,
                                                    **kwargs)


def _texts(response) -> list[str]:
    choices = sorted(response.choices, key=lambda c: c.index)
    assert len(choices) == SAMPLES and all(c.finish_reason == "stop" for c in choices)
    return [c.message.content if hasattr(c, "message") else c.text for c in choices]


def test_json_schema_samples_parse_and_match(hermes):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    for text in _texts(_chat(hermes, n=SAMPLES, max_tokens=80, response_format=fmt)):
        jsonschema.validate(json.loads(text), PERSON)


def test_a_whitespace_pattern_shapes_the_json_between_its_tokens(hermes):
    compact = _texts(_chat(hermes, n=SAMPLES, max_tokens=80, extra_body={"guided_json": PERSON}))
    spaced = _texts(_chat(hermes, n=SAMPLES, max_tokens=120, extra_body={
        "guided_json": PERSON, "guided_whitespace_pattern": "[ ]"}))
    for text in compact + spaced:
        jsonschema.validate(json.loads(text), PERSON)
    # Between the JSON's tokens (strings taken out): none by default; under the pattern,
    # gaps of exactly one space (llguidance lets a gap also be empty).
    gaps = [re.findall(r"\s+", re.sub(r'"(?:[^"\\]|\\.)*"', '""', t)) for t in compact + spaced]
    assert not any(gaps[:SAMPLES])
    assert all(g == " " for found in gaps[SAMPLES:] for g in found)
    assert sum(len(found) for found in gaps[SAMPLES:]) > SAMPLES, spaced[:3]


def test_json_object_samples_are_json_objects(hermes):
    # Any object at all: the random tiny model would write keys of hundreds of characters,
    # so a bias towards '"', ']' and '}' keeps its strings, lists and objects short (the
    # grammar alone decides what is valid; the bias only shifts the choice among valid tokens).
    short = {str(ord(c)): 4 for c in '"]}'}
    texts = _texts(_chat(hermes, n=SAMPLES, max_tokens=150, logit_bias=short,
                         response_format={"type": "json_object"}))
    assert all(isinstance(json.loads(text), dict) for text in texts)


@pytest.mark.parametrize("field, value, check", [
    ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ("guided_regex", r"[a-z]{2,5}@[0-9]{1,3}\.(com|org)",
     lambda t: re.fullmatch(r"[a-z]{2,5}@[0-9]{1,3}\.(com|org)", t) or pytest.fail(t)),
    ("guided_choice", ["red", "green", "blue"],
     lambda t: t in ("red", "green", "blue") or pytest.fail(t)),
    ("guided_grammar", 'start: "(" NUM (" + " NUM)? ")"\nNUM: /[1-9][0-9]?/',
     lambda t: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", t) or pytest.fail(t)),
    ("structured_outputs", {"regex": "(yes|no), [A-Z]{3}"},
     lambda t: re.fullmatch("(yes|no), [A-Z]{3}", t) or pytest.fail(t)),
])
def test_completions_samples_follow_each_kind(hermes, field, value, check):
    response = hermes.openai().completions.create(
        model="tiny", prompt="Answer:", n=SAMPLES, seed=3, max_tokens=80,
        extra_body={field: value})
    for text in _texts(response):
        check(text)


def test_each_choice_follows_its_own_grammar_when_streamed(hermes):
    stream = _chat(hermes, n=4, max_tokens=40, stream=True,
                   extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    texts = ["", "", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(t in ("alpha", "beta", "gamma") for t in texts), texts


def _check_calls(message, names: set[str]) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_named_tool_calls_arguments_always_parse(hermes):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = _chat(hermes, n=SAMPLES, max_tokens=40, tools=[WEATHER, TIME], tool_choice=named)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"get_time"})
        assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_parse_against_their_functions(hermes, parallel):
    # With parallel calls the random model would go on adding calls: a bias towards ']'
    # ends the list soon (the grammar still decides where ']' may go).
    response = _chat(hermes, n=SAMPLES, max_tokens=200, tools=[WEATHER, TIME],
                     tool_choice="required", parallel_tool_calls=parallel,
                     logit_bias={str(ord("]")): 8})
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"get_weather", "get_time"})
        assert parallel or len(choice.message.tool_calls) == 1


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str, list]:
    content, calls, finish, deltas = "", {}, None, []
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        deltas.append(delta)
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:  # a call's first delta: id, type and name
                assert part.index not in calls and part.type == "function"
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish, deltas


def test_named_tool_call_streams_name_then_argument_pieces(hermes):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = _chat(hermes, max_tokens=40, tools=[WEATHER], tool_choice=named, stream=True)
    content, calls, finish, deltas = _streamed_calls(stream)
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    assert deltas[0].tool_calls[0].function.arguments == ""  # the header comes alone
    assert sum(1 for d in deltas if d.tool_calls) > 3  # arguments arrive as they are made
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS["get_weather"])


def test_required_tool_calls_stream_as_deltas(hermes):
    stream = _chat(hermes, max_tokens=160, tools=[WEATHER, TIME], tool_choice="required",
                   parallel_tool_calls=False, stream=True)
    content, calls, finish, _ = _streamed_calls(stream)
    assert content == "" and finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_auto_hermes_finds_the_call_in_the_models_text(hermes):
    # The tiny model writes no tool calls by itself: a grammar makes it write one.
    forced = {"guided_choice": ["Sure. " + HERMES_CALL]}
    message = _chat(hermes, max_tokens=120, tools=[WEATHER], extra_body=forced).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content == "Sure."
    call = message.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    stream = _chat(hermes, max_tokens=120, tools=[WEATHER], stream=True, extra_body=forced)
    content, calls, finish, _ = _streamed_calls(stream)
    assert content == "Sure." and finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _answer(server, seed: int, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """A whole answer as (content, [(name, arguments)], finish reason)."""
    choice = server.openai().chat.completions.create(model="tiny", messages=CHAT, seed=seed,
                                                     **kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def _streamed_answer(server, seed: int, **kwargs) -> tuple[str | None, list, str, int]:
    """The same, streamed: the deltas put together, and how many carried arguments."""
    stream = server.openai().chat.completions.create(model="tiny", messages=CHAT, seed=seed,
                                                     stream=True, **kwargs)
    content, calls, finish, deltas = _streamed_calls(stream)
    pieces = sum(1 for d in deltas for part in d.tool_calls or []
                 if part.id is None and part.function.arguments)
    ordered = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    return content or None, ordered, finish, pieces


TWO_HERMES_CALLS = (r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                    r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>\n<tool_call>\n'
                    r'\{"name": "get_time", "arguments": \{"zone": -?[1-9]\}\}\n</tool_call>')
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("kwargs", [
    {"tool_choice": "required", "logit_bias": {str(ord("]")): 8}},
    {"tool_choice": NAMED},
    {"tool_choice": "auto", "extra_body": {"guided_regex": TWO_HERMES_CALLS}},
], ids=["required", "named", "auto-hermes"])
def test_streamed_calls_add_up_to_the_whole_answer(hermes, kwargs):
    # Each seed samples the same tokens whether streamed or not (one request at a time, so
    # the batch is the same): the deltas must put together exactly the whole answer.
    several = 0
    for seed in range(4):
        whole = _answer(hermes, seed, max_tokens=300, tools=[WEATHER, TIME], **kwargs)
        content, calls, finish, pieces = _streamed_answer(hermes, seed, max_tokens=300,
                                                          tools=[WEATHER, TIME], **kwargs)
        assert whole[2] == "tool_calls" and (content, calls, finish) == whole
        assert pieces > len(calls)  # arguments came in several pieces, not whole
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])
        several += len(calls) > 1
    if kwargs["tool_choice"] == "auto":
        assert several == 4 and whole[0] == "Let me look."


def test_auto_without_parallel_calls_answers_the_first_call_only(hermes):
    forced = {"guided_regex": TWO_HERMES_CALLS}
    whole = _answer(hermes, 1, max_tokens=300, tools=[WEATHER, TIME], parallel_tool_calls=False,
                    extra_body=forced)
    assert whole[2] == "tool_calls" and [name for name, _ in whole[1]] == ["get_weather"]
    streamed = _streamed_answer(hermes, 1, max_tokens=300, tools=[WEATHER, TIME],
                                parallel_tool_calls=False, extra_body=forced)
    assert streamed[:3] == whole


def test_auto_without_a_call_is_plain_content(hermes):
    choice = _chat(hermes, max_tokens=8, tools=[WEATHER]).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content


def test_auto_llama3_json_through_its_server(launch):
    server = launch("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    forced = {"guided_choice": [LLAMA3_CALL + "; " + LLAMA3_CALL.replace("2", "-5")]}
    whole = _answer(server, 0, max_tokens=200, tools=[TIME], extra_body=forced)
    assert whole == (None, [("get_time", '{"zone": 2}'), ("get_time", '{"zone": -5}')],
                     "tool_calls")
    assert _streamed_answer(server, 0, max_tokens=200, tools=[TIME],
                            extra_body=forced)[:3] == whole


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, "response_format"),
    ({"guided_json": '{"type": "object", '}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: x\nx: 'a' |"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_grammars_and_tools_get_a_400_naming_the_field(hermes, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(hermes, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert param in error["message"]


def test_auto_needs_the_servers_flags(server):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        _chat(server, max_tokens=4, tools=[WEATHER])
    choice = _chat(server, max_tokens=4, tools=[WEATHER], tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.message.content


def test_without_llguidance_a_grammar_gets_a_400_with_the_install_hint(launch, tmp_path):
    # A real server whose Python cannot import llguidance (a package that fails on import
    # stands first on its path); everything that needs no grammar still works.
    (tmp_path / "llguidance").mkdir()
    (tmp_path / "llguidance" / "__init__.py").write_text(textwrap.dedent("""\
        raise ImportError("No module named 'llguidance'")
        """))
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    server = launch(env={"PYTHONPATH": path})
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(server, max_tokens=4, extra_body={"guided_regex": "a+"})
    assert "pip install 'pdserve[structured]'" in caught.value.body["message"]
    assert caught.value.body["param"] == "guided_regex"
    assert _chat(server, max_tokens=2).choices[0].finish_reason == "length"
