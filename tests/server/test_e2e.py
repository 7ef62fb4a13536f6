"""End to end: the openai package against ``pdserve serve tiny`` (real engine, real socket)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.server.conftest import wait_engine_idle

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "tiny"


def test_completion(server):
    out = server.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                             temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert isinstance(choice.text, str)
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == 6  # BOS + 5 bytes (byte-level tokenizer)


def test_completion_token_ids_prompt(server):
    out = server.openai().completions.create(model=MODEL, prompt=[256, 72, 105], max_tokens=3,
                                             extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 3


def test_completion_stream_with_usage(server):
    stream = server.openai().completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    whole = server.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text


def test_chat(server):
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi there"}],
        max_tokens=4, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 4


def test_chat_stream(server):
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_seed_reproducible(server):
    client = server.openai()
    texts = [client.completions.create(model=MODEL, prompt="Once", max_tokens=8, seed=7,
                                       temperature=1.0, extra_body={"ignore_eos": True})
             .choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


def test_stop_string(server):
    client = server.openai()
    kwargs = dict(model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=24, **kwargs).choices[0].text
    visible = full.replace("\ufffd", "")
    if len(visible) < 4:
        pytest.skip("the dummy model produced too little printable text to cut")
    stop = visible[len(visible) // 2:len(visible) // 2 + 2]
    out = client.completions.create(max_tokens=24, stop=[stop], **kwargs)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]


def test_logprobs(server):
    client = server.openai()
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=0,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, logprobs=True,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3


def test_models_health_metrics(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.request("GET", "/health")[0] == 200
    names = server.metrics()
    for name in ("pdserve_time_to_first_token_seconds_count",
                 "pdserve_inter_token_latency_seconds_count",
                 "pdserve_e2e_request_latency_seconds_count", "pdserve_num_requests_running",
                 "pdserve_num_requests_waiting", "pdserve_kv_cache_usage_ratio",
                 "pdserve_prefix_cache_hit_rate", "pdserve_prompt_tokens_total",
                 "pdserve_generation_tokens_total"):
        assert name in names, name


def test_many_concurrent(server):
    async def one(client, i: int) -> int:
        if i % 2:
            out = await client.completions.create(model=MODEL, prompt=f"req {i}", max_tokens=8,
                                                  extra_body={"ignore_eos": True})
            return out.usage.completion_tokens
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"req {i}"}], max_tokens=8,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        return [c async for c in stream][-1].usage.completion_tokens

    async def run() -> list[int]:
        client = server.async_openai()
        return await asyncio.gather(*(one(client, i) for i in range(48)))

    assert asyncio.run(run()) == [8] * 48


def _wait_engine_busy(server, timeout: float = 5) -> None:
    # The gauges come from the engine's periodic stats snapshot, so they lag the stream a little.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["pdserve_num_requests_running"] + m["pdserve_num_requests_waiting"] >= 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine never reported the request: {m}")


def test_abort_on_disconnect(server):
    async def open_and_drop() -> None:
        body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 3000,
                "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the first chunk: the request is running
                _wait_engine_busy(server)
        # leaving the session closes the connection mid-stream

    before = server.metrics().get('pdserve_requests_finished_total{finish_reason="abort"}', 0)
    start = time.monotonic()
    asyncio.run(open_and_drop())
    metrics = wait_engine_idle(server)
    assert time.monotonic() - start < 20  # 3000 tokens would take minutes on CPU
    assert metrics["pdserve_kv_cache_free_blocks"] == 512
    assert metrics['pdserve_requests_finished_total{finish_reason="abort"}'] == before + 1


def _error(server, path: str, body, status: int = 400) -> dict:
    got, headers, raw = server.request("POST", path, body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["message"] and error["type"]
    return error


@pytest.mark.parametrize("body", [
    b"{not json", b"[1, 2]", b"\xff\xfe",
    {"prompt": "x", "max_tokens": "5"}, {"prompt": 5}, {"prompt": ""}, {"prompt": [-1]},
    {"prompt": [1, 2, 99999]}, {"prompt": "x", "temperature": "hot"},
    {"prompt": "x", "temperature": -1}, {"prompt": "x", "top_p": 0},
    {"prompt": "x", "top_p": 1.5}, {"prompt": "x", "top_k": -5}, {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "stop": 3}, {"prompt": "x", "seed": 1.5}, {"prompt": "x", "n": 0},
    {"prompt": "x", "stream": "yes"}, {"prompt": "x", "model": "gpt-4"},
    {"prompt": "x" * 5000}, {"prompt": "x", "max_tokens": 5000},
])
def test_completion_errors(server, body):
    _error(server, "/v1/completions", body)


@pytest.mark.parametrize("body", [
    {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
])
def test_chat_errors(server, body):
    _error(server, "/v1/chat/completions", body)


def test_openai_client_errors(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="not-served", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="y" * 5000)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-2)


def test_not_found_and_method(server):
    assert _error(server, "/v1/nothing", {}, status=404)
    got, _, _ = server.request("GET", "/v1/completions")
    assert got == 405


def test_still_healthy_after_errors(server):
    assert server.request("GET", "/health")[0] == 200
    out = server.openai().completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert out.usage.completion_tokens >= 1
