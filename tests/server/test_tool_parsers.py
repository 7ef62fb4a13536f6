"""The tool-call parsers on model text (the tiny model writes no tool calls by itself), and
the stream splitter that keeps a call's text out of streamed content."""

from __future__ import annotations

import json

import pytest

from pdserve.server.tool_calls import ToolRequest, ToolStream
from pdserve.structured.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    parse_required,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_hermes_reads_every_call_and_the_content_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = HermesParser().extract(text)
    assert content == "Let me check."
    assert calls == [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("get_time", "{}")]


@pytest.mark.parametrize("text", [
    "Just text, no call.",
    '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',  # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_hermes_leaves_what_is_not_a_well_formed_call_as_content(text):
    assert HermesParser().extract(text) == (text, [])


def test_hermes_holds_back_only_what_may_begin_a_call():
    parser = HermesParser()
    assert parser.content_end("Hello <tool") == len("Hello ")
    assert parser.content_end("Hello <tool_call>{") == len("Hello ")
    assert parser.content_end("a < b") == len("a < b")


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}',
     [ToolCall("get_weather", '{"city": "Rome"}')]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}', [ToolCall("f", '{"a": 1}')]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}',
     [ToolCall("f", "{}"), ToolCall("g", '{"b": [1]}')]),
])
def test_llama3_json_reads_one_or_more_calls(text, calls):
    assert Llama3JsonParser().extract(text) == (None, calls)


@pytest.mark.parametrize("text", ["The answer is {1, 2}.", '{"name": "f", "parameters": {',
                                  '{"no_name": 1}'])
def test_llama3_json_leaves_other_text_as_content(text):
    assert Llama3JsonParser().extract(text) == (text, [])


def test_llama3_json_streams_text_only_once_it_cannot_be_a_call():
    parser = Llama3JsonParser()
    assert parser.content_end("  ") == 0
    assert parser.content_end(' {"name"') == 0
    assert parser.content_end("<|python") == 0
    assert parser.content_end("Hi there") == len("Hi there")


def test_required_output_is_a_list_of_calls_or_nothing_when_cut_short():
    text = '[{"name": "get_weather", "parameters": {"city": "Lima"}}]'
    assert parse_required(text) == [ToolCall("get_weather", '{"city": "Lima"}')]
    assert parse_required(text[:-5]) is None


def test_a_stream_sends_content_then_each_calls_header_and_arguments():
    stream = ToolStream(ToolRequest([WEATHER], "auto", parser="hermes"))
    sent = []
    for piece in ["Sure", ". <tool", '_call>{"name": "get_weather", ',
                  '"arguments": {"city": "Oslo"}}</tool_call>']:
        sent += stream.push(piece, None)[0]
    deltas, finish = stream.push("", "stop")
    assert sent == [{"content": "Sure"}, {"content": ". "}] and finish == "tool_calls"
    header, arguments = deltas
    call = header["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == \
        (0, "function", {"name": "get_weather", "arguments": ""})
    assert json.loads(arguments["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_a_cut_short_required_stream_ends_as_content_with_length():
    stream = ToolStream(ToolRequest([WEATHER], "required"))
    assert stream.push('[{"name": "get_wea', None) == ([], None)
    assert stream.push("ther", "length") == ([{"content": '[{"name": "get_weather'}], "length")
