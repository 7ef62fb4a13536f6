"""The reasoning split (``--reasoning-parser deepseek_r1``): whole outputs, and streams cut
anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.server.reasoning import ThinkSplitter, split_reasoning


@pytest.mark.parametrize("text, reasoning, content", [
    ("I think so.</think>The answer is 4.", "I think so.", "The answer is 4."),
    ("<think>Hmm.</think>4", "Hmm.", "4"),  # a <think> the model writes first is dropped
    ("Still thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    ("</think>4", "", "4"),
    ("a</think>b</think>c", "a", "b</think>c"),  # only the first closes the thought
    ("x <think> y</think>z", "x <think> y", "z"),  # not leading: kept as text
    ("<thi", "<thi", ""),  # a tag never finished is text
    ("ends with </thi", "ends with </thi", ""),
])
def test_a_whole_output_splits_at_the_first_end_of_thought(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>Hmm.</think>4", "Hmm.", "4"),  # thinking mode: the model opens the thought
    ("4, without thinking", "", "4, without thinking"),  # no leading <think>: all answer
    ("<thi", "", "<thi"),  # a tag never finished is text
    ("<think>Still thinking", "Still thinking", ""),
    ("The </think> tag later", "", "The </think> tag later"),
])
def test_qwen3_thinks_only_in_an_output_that_opens_with_think(text, reasoning, content):
    assert split_reasoning(text, "qwen3") == (reasoning, content)
    splitter = ThinkSplitter("qwen3")  # a stream cut after every character says the same
    got = [splitter.push(c, final=i == len(text) - 1) for i, c in enumerate(text)]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content)


_ALPHABET = "ab <>/thinkT\n"


@given(st.text(alphabet=_ALPHABET, max_size=40), st.lists(st.integers(0, 40), max_size=8))
def test_a_stream_cut_anywhere_adds_up_to_the_whole_split(text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    splitter = ThinkSplitter()
    got = [splitter.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == split_reasoning(text)


def test_a_tag_split_between_pieces_is_held_back_not_sent_as_reasoning():
    splitter = ThinkSplitter()
    assert splitter.push("<th") == ("", "")
    assert splitter.push("ink>Let me see</") == ("Let me see", "")
    assert splitter.push("think>Yes") == ("", "Yes")
    assert splitter.push(" indeed", final=True) == ("", " indeed")


def _chat_format(**fields):
    from pdserve.server import protocol as P
    from pdserve.server.serving import Format

    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    request = P.ChatRequest.parse(body)
    return Format(True, "chatcmpl-1", "tiny", 0, request.sampling, reasoning="deepseek_r1",
                  include_reasoning=request.include_reasoning)


def _piece(text, finish=None):
    from pdserve.server.protocol import Piece

    return Piece(text, [1] * len(text), [], None, finish)


def test_a_whole_chat_answer_puts_the_thought_apart():
    fmt = _chat_format()
    body = fmt.full([_piece("Let me see.</think>It is 4.", "stop")], {})
    message = body["choices"][0]["message"]
    assert message["content"] == "It is 4."
    assert message["reasoning"] == message["reasoning_content"] == "Let me see."
    unfinished = fmt.full([_piece("Still thinking", "length")], {})["choices"][0]["message"]
    assert unfinished["content"] is None and unfinished["reasoning"] == "Still thinking"
    hidden = _chat_format(include_reasoning=False).full([_piece("a</think>b", "stop")], {})
    assert hidden["choices"][0]["message"] == {"content": "b", "role": "assistant"}


def test_a_streamed_chat_answer_sends_the_thought_and_the_answer_as_their_own_deltas():
    import json

    from pdserve.server.serving import _SSEWriter

    writer = _SSEWriter(None, None, _chat_format(), None)
    events = [writer.encode(_piece(text, finish)) for text, finish in
              [("Let", None), (" me see</th", None), ("ink>It", None), (" is 4", "stop")]]
    deltas = [json.loads(e[len(b"data: "):])["choices"][0]["delta"] for e in events if e]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me see"
    assert "".join(d.get("content", "") for d in deltas) == "It is 4"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_a_server_with_the_parser_answers_chats_thought_and_answer_apart(launch):
    """The tiny model never writes </think>, so its whole chat output is reasoning: the
    same text /v1/completions gives for the same prompt ids and seed (completions are not
    parsed)."""
    import json

    server = launch("--reasoning-parser", "deepseek_r1")
    messages = [{"role": "user", "content": "Think first"}]
    fields = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 3,
              "ignore_eos": True}
    ids = json.loads(server.request("POST", "/tokenize", {"model": "tiny",
                                                          "messages": messages})[2])["tokens"]
    raw = json.loads(server.request("POST", "/v1/completions",
                                    {**fields, "prompt": ids})[2])["choices"][0]["text"]
    reasoning, content = split_reasoning(raw)
    assert "</think>" not in raw and reasoning == raw and content == ""
    status, _, answer = server.request("POST", "/v1/chat/completions",
                                       {**fields, "messages": messages})
    message = json.loads(answer)["choices"][0]["message"]
    assert status == 200 and message["reasoning"] == raw and message["content"] is None
    usage = json.loads(answer)["usage"]  # every token was thought
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 12
    stream = server.openai().chat.completions.create(
        messages=messages, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
        **{k: v for k, v in fields.items() if k != "ignore_eos"})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == raw
    assert not any(d.content for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12
    # Under a grammar the output is the answer from its first token: nothing is split.
    status, _, answer = server.request("POST", "/v1/chat/completions", {
        **fields, "messages": messages, "guided_choice": ["yes", "no"]})
    message = json.loads(answer)["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning" not in message


@pytest.mark.parametrize("client_has, rest, reasoning, content", [
    ("Let me see</think>It", " is 4", "", " is 4"),  # resumed past the thought
    ("Let me", " see</think>4", " see", "4"),  # resumed inside it
    ("Let me see</th", "ink>4", "", "4"),  # inside its closing tag, held back there too
])
def test_a_resumed_p_d_stream_splits_on_from_where_the_client_is(client_has, rest, reasoning,
                                                                  content):
    """A P/D decode instance resuming another's answer: its split starts in the state the
    text the client holds leaves it in, and its chunks count the model's own characters
    they account for (what the gateway adds up to resume after)."""
    import json
    from types import SimpleNamespace

    from pdserve.server.serving import _SSEWriter

    fmt = _chat_format()
    fmt.with_token_ids = True
    resumed = SimpleNamespace(output=SimpleNamespace(resumed_text=client_has, resumed_tokens=0))
    writer = _SSEWriter(None, None, fmt, resumed)
    chunks = [json.loads(writer.encode(_piece(text, finish))[len(b"data: "):])
              for text, finish in [(rest[:2], None), (rest[2:], "stop")]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content
    assert sum(chunk["pdserve_text_chars"] for chunk in chunks) == len(rest)


@pytest.mark.parametrize("cut", [3, 12, 30, 44])
def test_a_resumed_p_d_stream_of_tool_calls_goes_on_where_the_client_is(cut):
    """Tool calls read from the text (``auto``, hermes): an answer resumed after ``cut``
    characters sends what one unbroken stream would have sent after them - the calls'
    argument pieces add up - and counts the characters it read."""
    import json
    from types import SimpleNamespace

    from pdserve.server import protocol as P
    from pdserve.server.serving import Format, _SSEWriter
    from pdserve.server.tool_calls import ToolRequest, ToolSettings

    text = ('Sure. <tool_call>{"name": "f", "arguments": {"city": "Oslo"}}</tool_call>')
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True,
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}
    tools = ToolRequest.read(body, ToolSettings(True, "hermes"))

    def deltas(client_has: str, rest: str, ends: bool = True) -> tuple[list[dict], int]:
        fmt = Format(True, "chatcmpl-1", "tiny", 0, P.ChatRequest.parse(body).sampling,
                     tools=tools, with_token_ids=True)
        gen = SimpleNamespace(output=SimpleNamespace(resumed_text=client_has, resumed_tokens=0))
        writer = _SSEWriter(None, None, fmt, gen)
        pieces = [(rest[i:i + 5], None) for i in range(0, len(rest), 5)]
        if ends:
            pieces[-1] = (pieces[-1][0], "stop")
        chunks = [json.loads(event[len(b"data: "):]) for text, finish in pieces
                  for event in writer.encode(_piece(text, finish)).split(b"\n\n") if event]
        counted = sum(chunk["pdserve_text_chars"] for chunk in chunks)
        return [chunk["choices"][0]["delta"] for chunk in chunks], counted

    def arguments(found: list[dict]) -> str:
        return "".join(call["function"].get("arguments", "") for d in found
                       for call in d.get("tool_calls") or [])

    def content(found: list[dict]) -> str:
        return "".join(d.get("content") or "" for d in found)

    whole, _ = deltas("", text)
    before, _ = deltas("", text[:cut], ends=False)  # what the client got before the break
    resumed, counted = deltas(text[:cut], text[cut:])
    assert counted == len(text) - cut
    assert arguments(before) + arguments(resumed) == arguments(whole)
    assert content(before) + content(resumed) == content(whole)
    assert sum(bool(d.get("tool_calls") and "id" in d["tool_calls"][0])
               for d in before + resumed) == 1  # the call's header once


def test_a_whole_answers_thought_tokens_are_counted_as_its_stream_counts_them():
    from pdserve.server.serving import _thought_tokens

    pieces = [_piece("Let"), _piece(" me</th"), _piece("ink>It"), _piece(" is", "stop")]
    assert _thought_tokens(pieces, "deepseek_r1") == len("Let me</th")  # a token a char
    splitter = ThinkSplitter()
    for piece in pieces:
        splitter.push(piece.text, piece.finish_reason is not None, len(piece.token_ids))
    assert splitter.thought_tokens == _thought_tokens(pieces, "deepseek_r1")


def test_summed_usage_sums_the_thoughts_where_every_part_counted_them():
    from pdserve.server import protocol as P

    parts = [P.usage(5, 4, 0, 3), P.usage(5, 6, 0, 6)]
    assert P.summed_usage(parts)["completion_tokens_details"] == {"reasoning_tokens": 9}
    assert "completion_tokens_details" not in P.summed_usage([*parts, P.usage(5, 1, 0)])
