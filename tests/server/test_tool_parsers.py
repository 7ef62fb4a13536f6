"""The tool-call readers on model text (the tiny model writes no tool calls by itself): the
whole answer's split, and the stream's events, which must add up to the same split however
the text is cut into pieces."""

from __future__ import annotations

import json

import pytest

from pdserve.server.tool_calls import ToolRequest, ToolStream
from pdserve.structured.tool_parsers import (
    Arguments,
    CallStart,
    Content,
    HermesReader,
    Llama3JsonReader,
    RequiredReader,
    ToolCall,
    read_whole,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _streamed(reader, text: str, size: int) -> tuple[str | None, list[ToolCall], bool]:
    """What a stream sends, cut into pieces of ``size`` characters, as (content, calls)."""
    events = []
    for start in range(0, len(text), size):
        events += reader.push(text[start:start + size])
    events += reader.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    arguments = {i: "" for i in names}
    for event in (e for e in events if isinstance(e, Arguments)):
        assert event.index in names  # a call's arguments never go out before its name
        arguments[event.index] += event.text
    return content or None, [ToolCall(names[i], arguments[i]) for i in sorted(names)], \
        reader.well_formed


WELL_FORMED = [
    (HermesReader, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
     "</tool_call>",
     ("Let me check.", [ToolCall("get_weather", '{"city": "Oslo"}'),
                        ToolCall("get_time", "{}")])),
    (HermesReader, '<tool_call>{"arguments": {"q": "a\\"}"}, "name": "f"}</tool_call>',
     (None, [ToolCall("f", '{"q": "a\\"}"}')])),  # the name last, a quote and } in a string
    (HermesReader, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     (None, [ToolCall("f", '{"a": 1}')])),  # arguments written as JSON text
    (Llama3JsonReader, '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     (None, [ToolCall("get_weather", '{"city": "Rome"}')])),
    (Llama3JsonReader, '<|python_tag|>{"name": "f", "arguments": {"a": 1}}',
     (None, [ToolCall("f", '{"a": 1}')])),
    (Llama3JsonReader, '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}',
     (None, [ToolCall("f", "{}"), ToolCall("g", '{"b": [1]}')])),
    (Llama3JsonReader, '{"name": "f", "parameters": {"n": -1.5e3, "t": true}}',
     (None, [ToolCall("f", '{"n": -1.5e3, "t": true}')])),
    (RequiredReader, '[{"name":"get_weather","parameters":{"city":"Lima"}},'
     '{"name":"get_time","parameters":{"zone":12}}]',
     (None, [ToolCall("get_weather", '{"city":"Lima"}'), ToolCall("get_time", '{"zone":12}')])),
]


@pytest.mark.parametrize("reader, text, expected", WELL_FORMED)
def test_well_formed_calls_read_the_same_whole_or_in_any_pieces(reader, text, expected):
    assert read_whole(reader(), text) == expected
    for size in (1, 2, 3, 7, len(text)):
        assert _streamed(reader(), text, size) == (*expected, True)


@pytest.mark.parametrize("reader, text", [
    (HermesReader, "Just text, no call."),
    (HermesReader, '<tool_call>{"name": "f", "arguments": {"x": </tool_call>'),  # broken JSON
    (HermesReader, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (Llama3JsonReader, "The answer is {1, 2}."),
    (Llama3JsonReader, '{"name": "f", "parameters": {'),
    (Llama3JsonReader, '{"no_name": 1}'),
    (Llama3JsonReader, '  {"name": "f", "parameters": {}} and more'),
    (RequiredReader, '[{"name": "get_weather", "parameters": {"city": "Li'),
])
def test_what_is_not_well_formed_calls_is_content_in_a_whole_answer(reader, text):
    assert read_whole(reader(), text) == (text, [])


@pytest.mark.parametrize("reader, text", [
    (HermesReader, "Plain answer <b>bold</b>  \n"),
    (Llama3JsonReader, "  Hi there"),
    (Llama3JsonReader, "<|python_ta"),
    (RequiredReader, '[{"name": "get_wea'),  # cut short before a name was read
])
def test_a_stream_with_no_call_sends_the_whole_text_as_content(reader, text):
    for size in (1, 4, len(text)):
        assert _streamed(reader(), text, size) == (text, [], False)


def test_hermes_streams_content_until_what_may_begin_a_call():
    reader = HermesReader()
    assert reader.push("Hello <tool") == [Content("Hello")]
    assert reader.push("_call>") == []
    assert reader.push('{"name": "f", "arguments": {"a"') == [CallStart(0, "f"),
                                                             Arguments(0, '{"a"')]
    assert reader.push(": 1}}</tool_call>") == [Arguments(0, ": 1}")]


def test_llama3_json_holds_text_only_while_it_may_be_a_call():
    reader = Llama3JsonReader()
    assert reader.push("  ") == [] and reader.push("<|python") == []
    reader = Llama3JsonReader()
    assert reader.push(" Hi") == [Content(" Hi")]


def test_a_malformed_call_after_its_start_went_out_ends_as_content():
    # The stream sent the call's start: what follows the fault is content, and the answer
    # does not finish as tool calls.
    reader = HermesReader()
    events = reader.push('<tool_call>{"name": "f", "arguments": {"x": 1}} oops</tool_call>')
    events += reader.finish()
    assert events[:2] == [CallStart(0, "f"), Arguments(0, '{"x": 1}')]
    assert "".join(e.text for e in events if isinstance(e, Content)).strip() == \
        "oops</tool_call>"
    assert not reader.well_formed


def _stream(request: ToolRequest, pieces: list[str], finish: str):
    stream = ToolStream(request)
    sent = [d for piece in pieces for d in stream.push(piece, None)[0]]
    deltas, reason = stream.push("", finish)
    return sent + deltas, reason


def test_a_stream_sends_content_then_each_calls_header_and_arguments():
    deltas, finish = _stream(ToolRequest([WEATHER], "auto", parser="hermes"),
                             ["Sure", ". <tool", '_call>{"name": "get_weather", ',
                              '"arguments": {"city": ', '"Oslo"}}</tool_call>'], "stop")
    assert finish == "tool_calls"
    assert deltas[:2] == [{"content": "Sure"}, {"content": "."}]
    header = deltas[2]["tool_calls"][0]
    assert (header["index"], header["type"], header["function"]) == \
        (0, "function", {"name": "get_weather", "arguments": ""})
    assert header["id"].startswith("call_")
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[3:]]
    assert len(pieces) == 2 and json.loads("".join(pieces)) == {"city": "Oslo"}


def test_without_parallel_calls_auto_keeps_the_first_call_only():
    request = ToolRequest([WEATHER], "auto", parallel=False, parser="llama3_json")
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 2}}'
    assert request.split(text) == (None, [ToolCall("a", "{}")])
    deltas, finish = _stream(request, [text[:40], text[40:]], "stop")
    assert finish == "tool_calls"
    assert {d["tool_calls"][0]["index"] for d in deltas} == {0}


def test_a_required_call_cut_short_keeps_length():
    request = ToolRequest([WEATHER], "required")
    deltas, finish = _stream(request, ['[{"name": "get_weather", "parameters": {"ci'],
                             "length")
    assert finish == "length" and deltas[0]["tool_calls"][0]["function"]["name"] == \
        "get_weather"
    assert request.split('[{"name": "get_weather", "parameters": {"ci') == \
        ('[{"name": "get_weather", "parameters": {"ci', [])
