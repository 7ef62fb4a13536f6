"""The streaming path: the dispatcher writes chunks inline while the socket has room and
hands them to the handler when it has not; stop strings end the stream exactly once."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.messages import RequestUpdate
from pdserve.model.tokenizer import ByteTokenizer
from pdserve.server import protocol as P
from pdserve.server.client import RequestStream
from pdserve.server.serving import Format, Generation, _SSEWriter

MODEL = "tiny"


class FakeTransport:
    """The socket's transport: the dispatcher's inline writes land here, framed."""

    def __init__(self, response: FakeResponse) -> None:
        self.buffered = 0  # what the socket would still hold
        self.response = response

    def write(self, data: bytes) -> None:
        size, _, rest = data.partition(b"\r\n")
        assert rest.endswith(b"\r\n") and int(size, 16) == len(rest) - 2  # one HTTP chunk
        self.response.data.append(rest[:-2])
        self.response.by_handler.append(asyncio.current_task().get_name() == "handler")

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.buffered


class FakeResponse:
    headers = {"Transfer-Encoding": "chunked"}  # as aiohttp sets it for HTTP/1.1

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.by_handler: list[bool] = []  # written by the handler task, not inline

    async def write(self, data: bytes) -> None:
        self.data.append(data)
        self.by_handler.append(asyncio.current_task().get_name() == "handler")


class FakeHttp:
    def __init__(self, response: FakeResponse) -> None:
        self.transport = FakeTransport(response)


class FakeClient:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.batch_received = 0.0  # as EngineClient: when its latest batch was read

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _writer(stop: list[str] | None = None) -> tuple[_SSEWriter, FakeResponse, FakeHttp]:
    body = P.CompletionRequest.parse({"prompt": "x", "max_tokens": 64, "stream": True,
                                      "stop": stop})
    fmt = Format(False, "cmpl-1", MODEL, 0, body.sampling)
    params = body.sampling.sampling_params(2, 4096, 16)
    gen = Generation(FakeClient(), RequestStream("cmpl-1", 0.0), ByteTokenizer(), [1, 2],
                     params)
    response = FakeResponse()
    http = FakeHttp(response)
    writer = _SSEWriter(http, response, fmt, gen)
    writer.sent_first = True
    return writer, response, http


def _delta(text: str, last: bool = False) -> list[tuple[RequestUpdate, float]]:
    return [(RequestUpdate("cmpl-1", list(text.encode()), None, last, "length" if last else None,
                        2, 0), 1.0)]


def _texts(chunks: list[bytes]) -> list[tuple[str, str | None]]:
    events = b"".join(chunks).split(b"\n\n")
    out = []
    for event in events:
        if event.startswith(b"data: {"):
            choice = json.loads(event[6:])["choices"][0]
            out.append((choice["text"], choice["finish_reason"]))
    return out


def _run(writer: _SSEWriter, feed) -> None:
    async def main() -> None:
        follow = asyncio.get_running_loop().create_task(writer.follow(), name="handler")
        await asyncio.sleep(0)
        for step in feed:
            step()
            await asyncio.sleep(0)
        await asyncio.wait_for(follow, 5)

    asyncio.run(main())


def test_chunks_keep_their_order_through_the_handler():
    writer, response, http = _writer()
    stream = writer.gen.stream

    def room(size: int):
        return lambda: setattr(http.transport, "buffered", size)

    feed = [lambda: stream.put(_delta("ab")), room(10**6), lambda: stream.put(_delta("cd")),
            lambda: stream.put(_delta("ef")), room(0), lambda: stream.put(_delta("gh", True))]
    _run(writer, feed)
    assert _texts(response.data) == [("ab", None), ("cd", None), ("ef", None), ("gh", "length")]
    assert response.by_handler == [False, True, True, False]
    assert writer.gen.done and stream.listener is None


def test_tokens_after_a_stop_string_are_dropped():
    writer, response, _ = _writer(stop=["cd"])
    stream = writer.gen.stream
    _run(writer, [lambda: stream.put(_delta("abc")), lambda: stream.put(_delta("de")),
                  lambda: stream.put(_delta("fg"))])
    assert _texts(response.data) == [("ab", None), ("", "stop")]
    assert writer.gen.num_generated == 4  # up to the "d" that completed "cd", not "e"
    assert writer.gen.client.aborted == ["cmpl-1"]


def test_an_engine_error_reaches_the_handler():
    writer, response, _ = _writer()
    stream = writer.gen.stream
    failed = [(RequestUpdate("cmpl-1", [], None, True, "error", 2, 0), 1.0)]
    with pytest.raises(P.APIError):
        _run(writer, [lambda: stream.put(_delta("ab")), lambda: stream.put(failed)])
    assert _texts(response.data) == [("ab", None)]


def test_streamed_stop_string_matches_the_whole_answer(server):
    pytest.importorskip("openai")
    client = server.openai()
    kwargs = dict(model=MODEL, prompt="abc", temperature=0, max_tokens=24,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    visible = full.replace("\ufffd", "")
    if len(visible) < 4:
        pytest.skip("the dummy model produced too little printable text to cut")
    stop = visible[len(visible) // 2:len(visible) // 2 + 2]
    whole = client.completions.create(stop=[stop], **kwargs)
    chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
