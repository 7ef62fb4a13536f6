"""Request ids as vLLM takes them: a ``request_id`` field or an ``X-Request-Id`` header
(the header wins) names the answer's id; two requests with one id never share the
engine's key; ``--enable-request-id-headers`` answers with the header."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import start_server

openai = pytest.importorskip("openai")

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def echoing_server():
    srv = start_server("--enable-request-id-headers", "--num-blocks", "256")
    yield srv
    srv.stop()


def test_the_field_and_the_header_name_the_answer(server):
    status, headers, body = server.request("POST", "/v1/chat/completions",
                                           {**CHAT, "request_id": "trace-7"})
    assert status == 200 and json.loads(body)["id"] == "chatcmpl-trace-7"
    assert "X-Request-Id" not in headers  # only with --enable-request-id-headers
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True,
                  "request_id": "from-body"}
    status, _, body = server.request("POST", "/v1/completions", completion,
                                     headers={"X-Request-Id": "from-header"})
    assert status == 200 and json.loads(body)["id"] == "cmpl-from-header"


def test_streamed_chunks_carry_the_id(server):
    stream = server.openai().chat.completions.create(
        model="tiny", messages=CHAT["messages"], max_tokens=3, stream=True,
        extra_body={"ignore_eos": True, "request_id": "streamed"})
    assert {chunk.id for chunk in stream} == {"chatcmpl-streamed"}


@pytest.mark.parametrize("value", ["", 5, "x" * 257, "new\nline"])
def test_a_bad_id_is_a_400_naming_it(server, value):
    status, _, body = server.request("POST", "/v1/chat/completions",
                                     {**CHAT, "request_id": value})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "request_id", error


def test_two_requests_with_one_id_both_finish(server):
    async def both():
        client = server.async_openai()
        return await asyncio.gather(*(client.completions.create(
            model="tiny", prompt="hi", max_tokens=8, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "same"}) for _ in range(2)))

    answers = asyncio.run(both())
    assert [a.id for a in answers] == ["cmpl-same", "cmpl-same"]
    assert [a.usage.completion_tokens for a in answers] == [8, 8]


def test_the_header_is_echoed_or_made(echoing_server):
    _, headers, _ = echoing_server.request("POST", "/v1/chat/completions", CHAT,
                                           headers={"X-Request-Id": "abc"})
    assert headers["X-Request-Id"] == "abc"
    _, headers, _ = echoing_server.request("GET", "/v1/models")
    assert len(headers["X-Request-Id"]) == 32  # a fresh uuid4 hex
    streamed = echoing_server.openai().chat.completions.with_raw_response.create(
        model="tiny", messages=CHAT["messages"], max_tokens=2, stream=True,
        extra_headers={"X-Request-Id": "streamed"})
    assert streamed.headers["x-request-id"] == "streamed"
