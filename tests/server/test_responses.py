"""OpenAI's Responses API (``/v1/responses``): requests read as the chat they run as,
answers and stream events checked against the openai package's own types, and a real
server answering the openai client as its chat endpoint answers the same conversation."""

from __future__ import annotations

import json
import re
import typing

import jsonschema
import pytest
from pydantic import ValidationError

from pdserve.server import protocol as P
from pdserve.server.reasoning import ThinkSplitter
from pdserve.server.responses import (
    RESPONSES_FIELDS,
    ResponseBuilder,
    ResponsesRequest,
    input_messages,
    responses_error,
    skeleton,
)
from pdserve.server.responses_store import ResponseStore, Stored
from pdserve.server.tool_calls import ToolRequest, ToolSettings, ToolStream

openai_types = pytest.importorskip("openai.types.responses")
# Each stream event's class in the openai package, by its type.
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in
          typing.get_args(typing.get_args(openai_types.ResponseStreamEvent)[0])}

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}


def _read(body, store=None):
    return ResponsesRequest.read(body, store or ResponseStore(8))


def _refused(body, store=None) -> P.APIError:
    with pytest.raises(P.APIError) as caught:
        _read(body, store)
    return caught.value


# ---- the request as a chat ------------------------------------------------------------------


def test_a_string_input_is_the_users_message_after_the_instructions():
    request = _read({"model": "tiny", "input": "Hi", "instructions": "Be brief",
                     "max_output_tokens": 5, "top_logprobs": 2, "user": "u1", "top_k": 3})
    assert request.chat["messages"] == [{"role": "system", "content": "Be brief"},
                                        {"role": "user", "content": "Hi"}]
    assert request.chat["max_completion_tokens"] == 5 and request.chat["top_k"] == 3
    assert request.chat["logprobs"] is True and request.chat["top_logprobs"] == 2
    assert request.chat["user"] == "u1" and request.store and not request.stream
    assert request.conversation == [{"role": "user", "content": "Hi"}]  # no instructions
    P.ChatRequest.parse(request.chat)  # a chat request the chat endpoint takes


def test_items_become_messages_with_calls_merged_into_the_assistants_turn():
    messages = input_messages([
        {"role": "developer", "content": "Use tools"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in "},
            {"type": "input_text", "text": "Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier thoughts: left out
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "sun"}]},
    ])
    assert messages == [
        {"role": "developer", "content": "Use tools"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun", "name": "get_weather"},
    ]
    P.read_messages(messages)  # as the chat reads them


def test_tools_and_text_format_take_the_chats_form():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = _read({"input": "x", "tools": [WEATHER], "parallel_tool_calls": False,
                     "tool_choice": {"type": "function", "name": "get_weather"},
                     "text": {"format": {"type": "json_schema", "name": "A", "schema": schema,
                                         "strict": True}}})
    assert request.chat["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert request.chat["tool_choice"] == {"type": "function",
                                           "function": {"name": "get_weather"}}
    assert request.chat["parallel_tool_calls"] is False
    assert request.chat["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    assert "response_format" not in _read({"input": "x", "text": {"format": {"type": "text"}}}
                                          ).chat


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "messages": []}, "messages"),  # a chat field is no Responses field
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "background": True, "stream": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
])
def test_what_it_cannot_honour_is_a_400_naming_the_field(body, param):
    error = _refused(body)
    assert (error.status, error.param) == (400, param)


def test_storing_refused_only_when_asked_of_a_server_that_keeps_none():
    none_kept = ResponseStore(0)
    assert not _read({"input": "x"}, none_kept).store  # OpenAI's default, quietly off
    assert _refused({"input": "x", "store": True}, none_kept).param == "store"
    assert not _read({"input": "x", "store": False}).store


def test_a_continuation_starts_from_the_stored_conversation_not_its_instructions():
    store = ResponseStore(2)
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    store.put(Stored({"id": "resp_1"}, earlier, []))
    request = _read({"input": "And?", "previous_response_id": "resp_1",
                     "instructions": "New"}, store)
    assert request.chat["messages"] == [{"role": "system", "content": "New"}, *earlier,
                                        {"role": "user", "content": "And?"}]
    assert store.get("resp_1").conversation == earlier  # not changed by the continuation
    missing = _refused({"input": "x", "previous_response_id": "resp_9"}, store)
    assert (missing.status, missing.param, missing.code) == (404, "response_id", "not_found")
    for i in (2, 3):  # the oldest is forgotten first
        store.put(Stored({"id": f"resp_{i}"}, [], []))
    assert store.get("resp_1") is None and store.get("resp_3") is not None


def test_a_chats_error_is_named_as_the_responses_api_names_it():
    error = responses_error(P.bad_request("'max_tokens' (9) is too large", param="max_tokens"))
    assert error.param == "max_output_tokens" and "'max_output_tokens'" in error.message
    assert responses_error(P.bad_request("bad", param="messages[2]")).param == "input"
    assert responses_error(P.bad_request("bad", param="seed")).param == "seed"


# ---- the answer ------------------------------------------------------------------------------


def _piece(text, finish=None, tokens=1, logprob=None):
    texts = [text] if logprob is not None else []
    return P.Piece(text, [7] * tokens, texts, [logprob] if logprob is not None else None,
                   finish, top_logprobs=[[(text, logprob)]] if logprob is not None else None)


def _builder(body=None, thinking=False, tools=None, logprobs=False):
    request = _read(body or {"input": "x"})
    return ResponseBuilder(skeleton(request, "resp_1", 0, "tiny", 1.0, 1.0),
                           ThinkSplitter("deepseek_r1") if thinking else None,
                           ToolStream(tools) if tools else None, logprobs)


def _run(builder, pieces, usage=None):
    usage = usage or P.usage(3, len(pieces), 1)
    events = builder.start()
    for piece in pieces:
        events += builder.push(piece)
    events += builder.finish(pieces[-1].finish_reason, usage)
    for event in events:  # every event as the openai package reads it
        _validate(EVENTS[event["type"]], event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    _validate(openai_types.Response, builder.response)
    return events, openai_types.Response.model_construct(**builder.response)


def _validate(cls, body) -> None:
    """``body`` as the openai package's ``cls`` reads it, strictly; the one field it may
    lack is the usage's ``cache_write_tokens``: the engine does not count what it writes to
    its prefix cache, so the answer does not say."""
    try:
        cls.model_validate(body)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if e["loc"][-1] != "cache_write_tokens"]
        assert not errors, errors


def _deltas(events, kind):
    return "".join(e["delta"] for e in events if e["type"] == kind)


def test_a_thought_then_text_become_a_reasoning_item_and_a_message():
    pieces = [_piece("Let me"), _piece(" see</th"), _piece("ink>It is"), _piece(" 4", "stop")]
    events, response = _run(_builder(thinking=True), pieces)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Let me see"
    assert response.output_text == "It is 4" and response.status == "completed"
    assert _deltas(events, "response.reasoning_text.delta") == "Let me see"
    assert _deltas(events, "response.output_text.delta") == "It is 4"
    assert response.usage.output_tokens_details.reasoning_tokens == 2  # the third has text
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count(
        "response.output_item.done") == 2


def test_max_output_tokens_leaves_it_incomplete():
    events, response = _run(_builder(), [_piece("a"), _piece("b", "length")])
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and events[-1]["type"] == \
        "response.incomplete"


def test_an_empty_answer_is_still_a_message():
    _, response = _run(_builder(), [_piece("", "stop", tokens=0)])
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == ""


def test_logprobs_follow_the_text_they_belong_to():
    _, response = _run(_builder({"input": "x", "top_logprobs": 1}, logprobs=True),
                       [_piece("a", logprob=-0.5), _piece("b", "stop", logprob=-1.0)])
    logprobs = response.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [("a", -0.5), ("b", -1.0)]
    assert logprobs[0].top_logprobs[0].token == "a"


def test_tool_calls_become_function_call_items_whose_argument_deltas_add_up():
    body = {"input": "x", "tools": [WEATHER], "tool_choice": "required"}
    tools = ToolRequest.read(_read(body).chat, ToolSettings())
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    pieces = [_piece(text[i:i + 7]) for i in range(0, len(text), 7)]
    pieces[-1].finish_reason = "stop"
    events, response = _run(_builder(body, tools=tools), pieces)
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id.startswith("call_")
    assert _deltas(events, "response.function_call_arguments.delta") == call.arguments


# ---- a real server, through the openai client ----------------------------------------------


def _chat_like(server, conversation, **fields):
    """The chat endpoint's answer to the same conversation and sampling."""
    return server.openai().chat.completions.create(model="tiny", messages=conversation,
                                                   **fields)


def test_a_response_is_the_chats_answer_to_the_same_conversation(server):
    client = server.openai()
    fields = {"temperature": 0.0, "max_output_tokens": 12}
    response = client.responses.create(model="tiny", input="Say something",
                                       instructions="You are terse", **fields)
    chat = _chat_like(server, [{"role": "system", "content": "You are terse"},
                               {"role": "user", "content": "Say something"}],
                      temperature=0.0, max_tokens=12)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected and response.id.startswith("resp_")
    assert response.instructions == "You are terse" and response.max_output_tokens == 12


def test_a_stream_adds_up_to_the_whole_response(server):
    client = server.openai()
    fields = {"model": "tiny", "input": "Stream it", "temperature": 0.0,
              "max_output_tokens": 10}
    whole = client.responses.create(**fields, store=False)
    events = list(client.responses.create(**fields, store=False, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].type in ("response.completed", "response.incomplete")
    # The SDK's accumulator, which wants a completed response: one a grammar ends.
    boolean = {"format": {"type": "json_schema", "name": "b", "schema": {"type": "boolean"}}}
    with client.responses.stream(**fields, store=False, text=boolean) as managed:
        for _ in managed:
            pass
        final = managed.get_final_response()
    assert final.status == "completed" and final.output_text in ("true", "false")
    status, headers, raw = server.request("POST", "/v1/responses", {**fields, "stream": True,
                                                                    "store": False})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    for block in raw.decode().strip().split("\n\n"):  # each event named as its type says
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        _validate(EVENTS[event["type"]], event)


def test_a_stored_response_is_continued_fetched_and_deleted(server):
    client = server.openai()
    first = client.responses.create(model="tiny", input="Hello", temperature=0.0,
                                    max_output_tokens=6, metadata={"who": "test"})
    second = client.responses.create(model="tiny", input="And then?", temperature=0.0,
                                     max_output_tokens=6, previous_response_id=first.id)
    chat = _chat_like(server, [{"role": "user", "content": "Hello"},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And then?"}],
                      temperature=0.0, max_tokens=6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text and fetched.metadata == {"who": "test"}
    listed = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [
        ("message", "user", "And then?")]  # its own input; the conversation is first's
    client.responses.delete(first.id)
    status, _, body = server.request("GET", f"/v1/responses/{first.id}")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, _, body = server.request("POST", "/v1/responses", {
        "model": "tiny", "input": "x", "previous_response_id": first.id})
    assert status == 404
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2,
                                       store=False)
    assert server.request("GET", f"/v1/responses/{unstored.id}")[0] == 404


def wait_for(client, response_id: str, timeout_s: float = 60.0):
    """A background response once it has ended."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, response.status
        time.sleep(0.05)


def test_a_background_response_is_followed_by_get_and_cancelled(server):
    from tests.server.conftest import wait_engine_idle

    client = server.openai()
    fields = {"model": "tiny", "input": "Later", "temperature": 0.0, "max_output_tokens": 12}
    queued = client.responses.create(**fields, background=True)
    assert queued.status == "queued" and queued.background
    done = wait_for(client, queued.id)
    assert done.output_text == client.responses.create(**fields, store=False).output_text
    assert done.usage.output_tokens == client.responses.retrieve(queued.id).usage.output_tokens
    aborted = 'pdserve_requests_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborted, 0)
    long = client.responses.create(model="tiny", input="Go on", max_output_tokens=4000,
                                   background=True, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == \
        "cancelled"
    assert server.metrics()[aborted] == before + 1  # stopped in the engine, not run out
    wait_engine_idle(server)
    assert client.responses.cancel(queued.id).status == done.status  # ended: as it is
    status, _, raw = server.request("POST", "/v1/responses", {**fields, "store": False})
    unstored = json.loads(raw)["id"]
    assert server.request("POST", f"/v1/responses/{unstored}/cancel")[0] == 404
    plain = client.responses.create(**fields)
    status, _, raw = server.request("POST", f"/v1/responses/{plain.id}/cancel")
    assert status == 400 and json.loads(raw)["error"]["param"] == "response_id"


def test_input_items_are_listed_a_page_at_a_time(server):
    client = server.openai()
    items = [{"role": "system", "content": "Be brief"},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Earlier", "annotations": []}]},
             {"role": "user", "content": "Now"}]
    response = client.responses.create(model="tiny", input=items, max_output_tokens=2)
    first = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.role for i in first.data] == ["system", "assistant"] and first.has_more
    assert first.data[1].content[0].text == "Earlier"
    rest = client.responses.input_items.list(response.id, order="asc", after=first.last_id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    newest = client.responses.input_items.list(response.id)  # newest first, as OpenAI
    assert [i.role for i in newest.data] == ["user", "assistant", "system"]
    _, _, raw = server.request("GET", f"/v1/responses/{response.id}/input_items")
    for item in json.loads(raw)["data"]:
        kind = openai_types.ResponseOutputMessage if item["role"] == "assistant" \
            else openai_types.ResponseInputMessageItem
        _validate(kind, item)
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=x", "after"),
                         ("before=x", "before")):
        status, _, raw = server.request("GET",
                                        f"/v1/responses/{response.id}/input_items?{query}")
        assert status == 400 and json.loads(raw)["error"]["param"] == param


def test_a_json_schema_format_and_a_named_tool_are_followed(server):
    client = server.openai()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    response = client.responses.create(
        model="tiny", input="A number", max_output_tokens=80, extra_body={"seed": 1},
        text={"format": {"type": "json_schema", "name": "N", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)
    called = client.responses.create(
        model="tiny", input="Weather?", max_output_tokens=80, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        # a bias towards '"' ends the city's string soon (the grammar decides where)
        extra_body={"seed": 1, "logit_bias": {str(ord('"')): 5}})
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answered = client.responses.create(  # the call's output sent back, continued
        model="tiny", max_output_tokens=4, previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert answered.status in ("completed", "incomplete")


def test_bad_requests_get_a_400_under_the_responses_names(server):
    for body, param in [({"model": "tiny", "input": "x", "max_tokens": 3}, "max_tokens"),
                        ({"model": "tiny", "input": "x", "max_output_tokens": 10 ** 7},
                         "max_output_tokens"),
                        ({"model": "other", "input": "x"}, "model")]:
        status, _, answer = server.request("POST", "/v1/responses", body)
        assert status == 400 and json.loads(answer)["error"]["param"] == param, answer


def test_a_reasoning_model_answers_with_a_reasoning_item(launch):
    """The tiny model never writes </think>: its whole output is the thought."""
    server = launch("--reasoning-parser", "deepseek_r1")
    fields = {"model": "tiny", "input": "Think", "temperature": 0.0, "max_output_tokens": 8}
    response = server.openai().responses.create(**fields)
    raw = server.openai().completions.create(
        model="tiny", temperature=0.0, max_tokens=8, prompt=json.loads(server.request(
            "POST", "/tokenize", {"messages": [{"role": "user", "content": "Think"}]})[2]
        )["tokens"]).choices[0].text
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == raw
    assert response.usage.output_tokens_details.reasoning_tokens == \
        response.usage.output_tokens


def test_the_docs_table_is_the_endpoints_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = text[text.index("### The Responses API"):]
    section = section[:section.index("\n### ")]
    rows = re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| (\w+) \|", section, re.MULTILINE)
    documented = {name: cell for names, cell in rows for name in re.findall(r"`(\w+)`", names)}
    assert documented == {name: "refused" if isinstance(rule, P.Refused) else "honoured"
                          for name, rule in RESPONSES_FIELDS.items()}
