"""The templated chunk encoding (prepared bytes around the text) gives the same bytes as
encoding the chunk's dict with ``json.dumps``, for any text and every option that changes a
chunk's fields; streamed through the dispatcher's inline writes, every event is its own
dict's ``json.dumps`` and the texts add up to what was generated."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.messages import RequestUpdate
from pdserve.model.tokenizer import ByteTokenizer
from pdserve.server import protocol as P
from pdserve.server.client import RequestStream
from pdserve.server.serving import Format, Generation, _SSEWriter
from tests.server.test_streaming import FakeClient, FakeHttp, FakeResponse, _run

TRICKY = st.sampled_from(["", '"', "\\", "\n", "\r\n", "\t", "\x00", "\x1f", "\x7f", "\u2028",
                          "é", "日本", "😀", "👩‍👩‍👧", '\\"', "</s>", "\ufeff"])
TEXTS = st.lists(st.one_of(TRICKY, st.text(max_size=6)), max_size=5).map("".join)
OPTIONS = st.fixed_dictionaries({
    "chat": st.booleans(),
    "include_usage": st.booleans(),
    "return_engine_timing": st.booleans(),
    "with_token_ids": st.booleans(),
    "logprobs": st.booleans(),
})


def _writer(options: dict) -> _SSEWriter:
    body = {"max_tokens": 256, "stream": True,
            "return_engine_timing": options["return_engine_timing"]}
    if options["include_usage"]:
        body["stream_options"] = {"include_usage": True}
    if options["chat"]:
        body |= {"messages": [{"role": "user", "content": "x"}],
                 "logprobs": options["logprobs"]}
        request = P.ChatRequest.parse(body)
    else:
        body |= {"prompt": "x", "logprobs": 0 if options["logprobs"] else None}
        request = P.CompletionRequest.parse(body)
    fmt = Format(options["chat"], "cmpl-1", "tiny", 1700000000, request.sampling,
                 with_token_ids=options["with_token_ids"])
    params = request.sampling.sampling_params(2, 4096, 16)
    gen = Generation(FakeClient(), RequestStream("cmpl-1", 0.0), ByteTokenizer(), [1, 2],
                     params)
    response = FakeResponse()
    return _SSEWriter(FakeHttp(response), response, fmt, gen)


def _general_encoding(writer: _SSEWriter, piece: P.Piece) -> bytes:
    """The chunk built as a dict and dumped whole (the path chunks with logprobs, a finish
    reason or a role take)."""
    templated, writer._templated = writer._templated, False
    try:
        return writer.encode(piece)
    finally:
        writer._templated = templated


@settings(max_examples=300, deadline=None)
@given(options=OPTIONS, text=TEXTS, engine_time=st.floats(0, 1e6, allow_nan=False),
       token_ids=st.lists(st.integers(0, 300), min_size=1, max_size=4))
def test_templated_chunk_is_the_dumped_dict(options, text, engine_time, token_ids):
    options["logprobs"] = False  # chunks with logprobs never take the template
    fast, general = _writer(options), _writer(options)
    fast.sent_first = general.sent_first = True
    piece = P.Piece(text, token_ids, [], None, engine_time=engine_time)
    data = fast.encode(piece)
    reference = _general_encoding(general, piece)
    assert fast.offset == general.offset == len(text)
    if not data:  # nothing worth a chunk: no text, and no extension asked for every token
        assert not reference and not (options["return_engine_timing"] or
                                      options["with_token_ids"])
        return
    if options["chat"] and not text:
        # Known difference, kept as clients have always got it: the template always carries
        # the delta's "content"; the dict path leaves an empty one out.
        reference = reference.replace(b'"delta":{}', b'"delta":{"content":""}')
    assert data == reference


def _steps(text: str, cuts: list[int]) -> list[list[int]]:
    """``text``'s UTF-8 bytes (the byte tokenizer's tokens) cut into steps at ``cuts``:
    multi-byte characters and emoji end up split across steps."""
    data = list(text.encode())
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _events(data: list[bytes]) -> list[bytes]:
    return [e + b"\n\n" for e in b"".join(data).split(b"\n\n") if e]


@settings(max_examples=150, deadline=None)
@given(options=OPTIONS, text=TEXTS.filter(bool), cuts=st.lists(st.integers(0, 64), max_size=6))
def test_streamed_events_are_their_dicts_dumped(options, text, cuts):
    writer = _writer(options)
    writer.sent_first = True  # the handler wrote the first chunk; the listener writes on
    steps = _steps(text, cuts)
    stream = writer.gen.stream

    def put(ids: list[int], last: bool):
        logprobs = [-0.5] * len(ids) if options["logprobs"] else None
        update = RequestUpdate("cmpl-1", ids, logprobs, last, "length" if last else None, 2, 0)
        return lambda: stream.put([(update, 12.5)])

    _run(writer, [put(ids, i == len(steps) - 1) for i, ids in enumerate(steps)])
    events = _events(writer.response.data)
    bodies = [json.loads(e[len(b"data: "):]) for e in events]
    assert [P.sse(body) for body in bodies] == events
    key = "delta" if options["chat"] else "text"
    texts = [b["choices"][0][key] for b in bodies]
    got = "".join(t.get("content", "") if options["chat"] else t for t in texts)
    assert got == text
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
