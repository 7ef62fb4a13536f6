"""P/D across instances end to end: real `pdserve serve` processes on the tiny model, KV over
real TCP, and the gateway over real HTTP. What a client gets through the gateway must equal
what one instance answers alone (greedy)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest
from aiohttp import web

from pdserve.cluster.app import start_gateway, stop_gateway
from pdserve.cluster.config import GatewayConfig
from pdserve.cluster.registry import Instance, MemoryRegistry
from tests.server.conftest import (
    Server,
    free_port,
    start_server,
    start_servers,
    stop_servers,
    trusting,
    wait_engine_idle,
    write_tls_files,
)

pytestmark = pytest.mark.slow
SCENARIO = "default"


class GatewayThread:
    """The gateway on its own event loop in a thread of the test process."""

    def __init__(self, registry, client_tls=None, **options) -> None:
        self.port = free_port()
        config = GatewayConfig(host="127.0.0.1", port=self.port, **options)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner, self.gateway, self.ratio = self._call(start_gateway(config, registry))
        # the raw-HTTP and openai helpers (over TLS with a test CA's context)
        self.http = Server(None, self.port, client_tls=client_tls)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self._call(stop_gateway(self.runner, self.gateway, self.ratio))
        self.loop.call_soon_threadsafe(self.loop.stop)


def _instance(server: Server, role: str, name: str | None = None) -> Instance:
    _, _, raw = server.request("GET", "/pd/info")
    info = json.loads(raw)
    address = f"127.0.0.1:{server.port}"
    return Instance(name or address, SCENARIO, role, address, info["kv_address"], info["model"],
                    info["schedule"])


@pytest.fixture(scope="module")
def instances():
    prefill, decode = start_servers(("--kv-transfer-port", "0"), ("--kv-transfer-port", "0"))
    yield prefill, decode
    stop_servers((prefill, decode))


@pytest.fixture
def registry(instances):
    registry = MemoryRegistry()
    registry.register(_instance(instances[0], "prefill"))
    registry.register(_instance(instances[1], "decode"))
    yield registry
    registry.close()


@pytest.fixture
def gateway(registry):
    gateway = GatewayThread(registry)
    yield gateway
    gateway.stop()


def _complete(server: Server, body: dict) -> dict:
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)


BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}


def test_completion_through_the_gateway_equals_one_instance(instances, gateway):
    alone = _complete(instances[0], BODY)
    split = _complete(gateway.http, BODY)
    assert split["choices"][0]["text"] == alone["choices"][0]["text"]
    assert split["usage"]["completion_tokens"] == 24
    assert split["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    _, _, raw = instances[1].request("GET", "/pd/info")
    assert json.loads(raw)["model"] == "tiny"


def test_streaming_chat_through_the_gateway_with_the_openai_client(instances, gateway):
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    alone = instances[0].openai().chat.completions.create(**kwargs)
    stream = gateway.http.openai().chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16


def test_a_request_id_header_names_the_answer_through_the_gateway(gateway):
    """The gateway passes ``X-Request-Id`` on as the body's ``request_id``: the prefill and
    decode instances name the answer by it, streamed or whole."""
    client = gateway.http.openai()
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(extra_headers={"X-Request-Id": "pd-1"}, **kwargs)
    assert whole.id == "chatcmpl-pd-1"
    stream = client.chat.completions.create(stream=True, extra_headers={"X-Request-Id": "pd-2"},
                                            **kwargs)
    assert {chunk.id for chunk in stream} == {"chatcmpl-pd-2"}


def test_many_concurrent_requests_each_get_their_own_tokens(instances, gateway):
    prompts = [f"Request number {i} says" for i in range(12)]
    expected = [_complete(instances[0], {**BODY, "prompt": p, "max_tokens": 8})
                ["choices"][0]["text"] for p in prompts]

    async def run() -> list[str]:
        client = gateway.http.async_openai()
        answers = await asyncio.gather(*[
            client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}) for p in prompts])
        return [a.choices[0].text for a in answers]

    assert asyncio.run(run()) == expected
    # Every page back in both pools once the answers are in; the idle snapshot also carries
    # the transfer count (gauges come from the engine's periodic snapshot, and lag).
    idle = [wait_engine_idle(server) for server in instances]
    assert idle[1]["pdserve_kv_transfers_total"] >= len(prompts)  # received by decode


def test_bad_request_is_answered_by_the_instance_and_relayed(gateway):
    status, _, raw = gateway.http.request("POST", "/v1/completions",
                                          {"prompt": "x", "temperature": -1})
    assert status == 400
    error = json.loads(raw)["error"]
    assert "temperature" in error["message"] and error["param"] == "temperature"
    status, _, raw = gateway.http.request("POST", "/v1/completions", b"{not json")
    assert status == 400


def test_a_batch_of_prompts_and_n_choices_through_the_gateway(instances, gateway):
    batch = {**BODY, "prompt": ["The quick brown fox", [1, 72, 105], "Tell me"],
             "max_tokens": 8}
    alone = _complete(instances[0], batch)
    split = _complete(gateway.http, batch)
    assert [c["index"] for c in split["choices"]] == [0, 1, 2]
    assert [c["text"] for c in split["choices"]] == [c["text"] for c in alone["choices"]]
    assert split["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert split["usage"]["completion_tokens"] == 3 * 8
    # n choices of each prompt: choice j as the request with seed + j, prompts counted once
    sampled = {**batch, "temperature": 1.0, "seed": 5, "n": 2, "max_tokens": 6}
    both = _complete(gateway.http, sampled)
    assert [c["index"] for c in both["choices"]] == list(range(6))
    one = _complete(gateway.http, {**sampled, "prompt": batch["prompt"][1], "n": 1, "seed": 6})
    assert both["choices"][3]["text"] == one["choices"][0]["text"]
    assert both["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert both["usage"]["completion_tokens"] == 6 * 6
    status, _, raw = gateway.http.request("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": 3,
        "max_tokens": 4, "ignore_eos": True})
    chat = json.loads(raw)
    assert status == 200 and [c["index"] for c in chat["choices"]] == [0, 1, 2], raw
    assert chat["usage"]["completion_tokens"] == 12
    # best_of: the best n of best_of by summed logprobs, every generated token billed
    best = _complete(gateway.http, {**BODY, "prompt": "Hi", "temperature": 1.0, "seed": 7,
                                    "best_of": 3, "max_tokens": 5})
    singles = [_complete(gateway.http, {**BODY, "prompt": "Hi", "temperature": 1.0,
                                        "seed": seed, "max_tokens": 5, "logprobs": 0})
               for seed in (7, 8, 9)]
    top = max(singles, key=lambda a: sum(a["choices"][0]["logprobs"]["token_logprobs"]))
    assert best["choices"][0]["text"] == top["choices"][0]["text"]
    assert best["choices"][0]["logprobs"] is None and len(best["choices"]) == 1
    assert best["usage"]["completion_tokens"] == 15
    status, _, raw = gateway.http.request("POST", "/v1/completions", {
        **BODY, "prompt": "Hi", "best_of": 2, "echo": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "echo", raw
    # streamed: each part's chunks under its index, one id, the usage of all at the end
    for body, path, count in ((sampled, "/v1/completions", 6),
                              ({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                "n": 3, "max_tokens": 4, "ignore_eos": True, "seed": 2,
                                "temperature": 1.0}, "/v1/chat/completions", 3)):
        whole = json.loads(gateway.http.request("POST", path, body)[2])
        status, _, raw = gateway.http.request("POST", path, {
            **body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        texts: dict[int, str] = {}
        for event in events[:-1]:
            (choice,) = event["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice.get("text") or choice.get("delta", {}).get("content") or "")
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        assert len({e["id"] for e in events}) == 1 and events[-1]["choices"] == []
        assert events[-1]["usage"] == whole["usage"]
        assert texts == {c["index"]: c.get("text") or c["message"]["content"]
                         for c in whole["choices"]} and len(texts) == count
    # a refused prompt refuses the batch, as one instance does
    for stream in (False, True):  # streamed too: the answer opens once every part started
        status, _, raw = gateway.http.request("POST", "/v1/completions", {
            **batch, "prompt": ["a", [1, 10**9]], "stream": stream})
        assert status == 400 and json.loads(raw)["error"]["param"] == "prompt", raw


def test_tokenize_and_detokenize_through_the_gateway_are_an_instance_s(instances, gateway):
    for path, body in (("/tokenize", {"prompt": "Hello"}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                      "return_token_strs": True}),
                       ("/detokenize", {"tokens": [256, 72, 105]})):
        want = instances[0].request("POST", path, body)
        got = gateway.http.request("POST", path, body)
        assert got[0] == want[0] == 200 and json.loads(got[2]) == json.loads(want[2]), path
    status, _, raw = gateway.http.request("POST", "/tokenize", {"prompt": 5})
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"


def test_embeddings_through_the_gateway_are_an_instance_s(instances, gateway):
    body = {"model": "tiny", "input": ["Hello", [5, 6, 7]]}
    want = json.loads(instances[0].request("POST", "/v1/embeddings", body)[2])
    status, _, raw = gateway.http.request("POST", "/v1/embeddings", body)
    got = json.loads(raw)
    assert status == 200 and got["usage"] == want["usage"]
    for a, b in zip(got["data"], want["data"], strict=True):
        assert a["index"] == b["index"]
        assert a["embedding"] == pytest.approx(b["embedding"], abs=1e-5)
    status, _, raw = gateway.http.request("POST", "/v1/embeddings", {"input": "x",
                                                                     "dimensions": 4})
    assert status == 400 and json.loads(raw)["error"]["param"] == "dimensions"
    for path, body in (("/score", {"text_1": "a", "text_2": ["b", "c"]}),
                       ("/rerank", {"query": "a", "documents": ["b", "c"]})):
        want = json.loads(instances[0].request("POST", path, body)[2])
        got = json.loads(gateway.http.request("POST", path, body)[2])
        scores = [[r.get("score", r.get("relevance_score")) for r in a.get("data") or
                   a["results"]] for a in (want, got)]
        assert scores[1] == pytest.approx(scores[0], abs=1e-5), path


def test_the_gateways_api_key_guards_the_openai_routes_and_tokenization(registry):
    gateway = GatewayThread(registry, api_key="sesame")
    try:
        for method, path, body in (("GET", "/v1/models", None),
                                   ("POST", "/tokenize", {"prompt": "Hi"}),
                                   ("POST", "/rerank", {"query": "a", "documents": ["b"]}),
                                   ("POST", "/v1/completions", {**BODY, "max_tokens": 2})):
            assert gateway.http.request(method, path, body)[0] == 401, path
            status, _, raw = gateway.http.request(
                method, path, body, headers={"Authorization": "Bearer sesame"})
            assert status == 200, (path, raw)
        assert gateway.http.request("GET", "/health")[0] == 200  # open, for probes
    finally:
        gateway.stop()


def test_the_gateway_answers_cross_origin_calls_for_the_listed_origins(registry):
    """As the server's: a preflight without the key, the P/D answer with the header; an
    origin not listed gets none."""
    gateway = GatewayThread(registry, api_key="sesame",
                            allowed_origins=("http://good.example",))
    preflight = {"Origin": "http://good.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    try:
        status, headers, _ = gateway.http.request("OPTIONS", "/v1/completions",
                                                  headers=preflight)
        assert status == 200
        assert headers["Access-Control-Allow-Origin"] == "http://good.example"
        status, headers, _ = gateway.http.request("POST", "/v1/completions", BODY, headers={
            "Origin": "http://good.example", "Authorization": "Bearer sesame"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://good.example"
        status, headers, _ = gateway.http.request("POST", "/v1/completions", BODY, headers={
            "Origin": "http://other.example", "Authorization": "Bearer sesame"})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
    finally:
        gateway.stop()


def test_the_gateway_serves_https_in_front_of_plain_http_instances(registry, tmp_path):
    pytest.importorskip("trustme")
    ca = write_tls_files(tmp_path)
    gateway = GatewayThread(registry, client_tls=trusting(ca),
                            ssl_keyfile=str(tmp_path / "key.pem"),
                            ssl_certfile=str(tmp_path / "cert.pem"))
    try:
        assert gateway.http.url.startswith("https://")
        out = gateway.http.openai().completions.create(model="tiny", prompt="Hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        with pytest.raises(OSError):  # plain HTTP gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{gateway.port}/health", timeout=10)
    finally:
        gateway.stop()


def test_unknown_or_bad_scenario(gateway):
    status, _, raw = gateway.http.request("POST", "/v1/completions", BODY,
                                          headers={"X-PD-Scenario": "other"})
    assert status == 503 and "scenario 'other'" in json.loads(raw)["error"]["message"]
    status, _, raw = gateway.http.request("POST", "/v1/completions", BODY,
                                          headers={"X-PD-Scenario": "a/b"})
    assert status == 400 and "X-PD-Scenario" in json.loads(raw)["error"]["message"]


def test_gateway_lists_models_groups_and_health(instances, gateway):
    status, _, raw = gateway.http.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["tiny"]
    one = json.loads(instances[1].request("GET", "/v1/models")[2])["data"][0]
    assert json.loads(raw)["data"][0]["max_model_len"] == one["max_model_len"] > 0
    status, _, raw = gateway.http.request("GET", "/v1/models/tiny")
    assert status == 200 and json.loads(raw)["max_model_len"] == one["max_model_len"]
    assert gateway.http.request("GET", "/v1/models/other")[0] == 404
    _, _, raw = gateway.http.request("GET", "/cluster/groups")
    groups = json.loads(raw)["groups"][SCENARIO]
    assert len(groups["prefill"]) == 1 and len(groups["decode"]) == 1
    assert gateway.http.request("GET", "/health")[0] == 200


# ---- on-demand forwarding ---------------------------------------------------------------


class StandIn:
    """A fake instance on its own event loop: ``route`` (path, handler name) is all it serves."""

    route = ("/pd/prefill", "_refuse")

    def __init__(self) -> None:
        self.port = free_port()
        self.offers = 0
        self.last_offer: dict = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        path, handler = self.route
        app.router.add_post(path, getattr(self, handler))
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class RefusingInstance(StandIn):
    """A prefill instance that is always too busy: answers 429 and counts the offers."""

    async def _refuse(self, request: web.Request) -> web.Response:
        self.offers += 1
        self.last_offer = await request.json()
        return web.json_response({"error": {"message": "busy", "code": "prefill_busy"}},
                                 status=429)

    def instance(self) -> Instance:
        # Named to sort first: with equal load the gateway offers to it before the real one.
        return Instance("0-refusing", SCENARIO, "prefill", f"127.0.0.1:{self.port}",
                        "127.0.0.1:1", "tiny")


def test_refused_prefill_is_offered_to_the_next_instance(instances, registry):
    refusing = RefusingInstance()
    registry.register(refusing.instance())
    gateway = GatewayThread(registry)
    try:
        answer = _complete(gateway.http, BODY)
        assert answer["choices"][0]["text"] == _complete(instances[0], BODY)["choices"][0]["text"]
        assert refusing.offers == 1
        assert refusing.last_offer["ttft_budget_ms"] > 0  # what is left of the TTFT SLO
        metrics = gateway.http.metrics()
        assert metrics['pdserve_gateway_prefill_rejections_total{instance="0-refusing"}'] == 1
    finally:
        gateway.stop()
        refusing.stop()


def test_when_every_prefill_instance_refuses_the_gateway_answers_503(instances):
    refusing = RefusingInstance()
    registry = MemoryRegistry()
    registry.register(refusing.instance())
    registry.register(_instance(instances[1], "decode"))
    gateway = GatewayThread(registry, max_wait_s=0.3)
    try:
        start = time.monotonic()
        status, headers, raw = gateway.http.request("POST", "/v1/completions", BODY)
        assert status == 503 and headers["Retry-After"] == "1"
        assert "busy" in json.loads(raw)["error"]["message"]
        assert refusing.offers >= 2  # it went round again before giving up
        assert time.monotonic() - start < 5
    finally:
        gateway.stop()
        refusing.stop()
        registry.close()


@pytest.fixture(scope="module")
def multiplex_decode():
    server = start_server("--kv-transfer-port", "0", "--schedule", "multiplex")
    yield server
    server.stop()


@pytest.mark.parametrize("with_prefill", [True, False])
def test_multiplexing_decode_instance_prefills_what_every_prefill_instance_refused(
        instances, multiplex_decode, with_prefill):
    """The gateway's last resort: the request runs whole on the multiplexing decode
    instance (no KV transfer), with the tokens one instance gives alone."""
    refusing = RefusingInstance()
    registry = MemoryRegistry()
    if with_prefill:
        registry.register(refusing.instance())
    registry.register(_instance(multiplex_decode, "decode"))
    gateway = GatewayThread(registry, max_wait_s=0.3)
    try:
        answer = _complete(gateway.http, BODY)
        assert answer["choices"][0]["text"] == _complete(instances[0], BODY)["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] == BODY["max_tokens"]
        assert refusing.offers == (1 if with_prefill else 0)
        metrics = gateway.http.metrics()
        assert metrics['pdserve_gateway_local_prefills_total{scenario="default"}'] == 1
        _, _, raw = multiplex_decode.request("GET", "/pd/info")
        assert json.loads(raw)["schedule"] == "multiplex"
    finally:
        gateway.stop()
        refusing.stop()
        registry.close()


def test_prefill_here_is_refused_by_an_instance_that_does_not_multiplex(instances):
    body = {"kind": "completions", "request": BODY, "prefill_here": True}
    status, _, raw = instances[1].request("POST", "/pd/decode", body)
    assert status == 400 and "multiplex" in json.loads(raw)["error"]["message"]


def test_no_decode_instance_is_a_clear_503(instances):
    registry = MemoryRegistry()
    registry.register(_instance(instances[0], "prefill"))
    gateway = GatewayThread(registry)
    try:
        status, _, raw = gateway.http.request("POST", "/v1/completions", BODY)
        assert status == 503 and "no decode instance" in json.loads(raw)["error"]["message"]
        assert gateway.http.request("GET", "/health")[0] == 503
    finally:
        gateway.stop()
        registry.close()


def test_prefill_instance_refuses_what_it_cannot_start_in_time(instances):
    """The instance's own admission: with a long prefill in flight and a zero queue budget,
    a second offer is refused at once; with budget it is taken."""
    prefill = instances[0]
    long_body = {"kind": "completions", "transfer_id": "long", "kv_target": "127.0.0.1:1",
                 "request": {"prompt": "word " * 400, "max_tokens": 2}}
    status, _, raw = prefill.request("POST", "/pd/prefill", long_body)  # measures the rate
    assert status == 200, raw

    async def race() -> tuple[list[int], int]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            url = prefill.url + "/pd/prefill"
            busy = [asyncio.ensure_future(session.post(url, json={**long_body,
                                                                  "transfer_id": f"b{i}"}))
                    for i in range(6)]
            while not json.loads(prefill.request("GET", "/pd/info")[2])["queued_prefill_tokens"]:
                await asyncio.sleep(0.005)  # until the instance has them in hand
            refused = await session.post(url, json={**long_body, "transfer_id": "s",
                                                    "ttft_budget_ms": 0})
            return [(await b).status for b in busy], refused.status

    busy, refused = asyncio.run(race())
    assert busy == [200] * 6 and refused == 429
    metrics = prefill.metrics()
    assert metrics['pdserve_pd_prefill_offers_total{outcome="refused"}'] >= 1
    assert metrics["pdserve_pd_prefill_tokens_per_second"] > 0
    _, _, raw = prefill.request("GET", "/pd/info")
    info = json.loads(raw)
    assert info["rejected"] >= 1 and info["queued_prefill_tokens"] == 0
    assert info["prefill_tokens_per_s"] > 0


@pytest.mark.parametrize("dispatch", ["least-connections", "round-robin"])
def test_blind_dispatch_never_lets_an_instance_refuse(instances, registry, dispatch):
    recorder = RefusingInstance()
    registry.register(recorder.instance())
    gateway = GatewayThread(registry, dispatch=dispatch)
    try:
        for _ in range(2):  # round-robin reaches the recorder within two requests
            assert _complete(gateway.http, BODY)["usage"]["completion_tokens"] == 24
        assert recorder.offers >= 1 and recorder.last_offer["ttft_budget_ms"] is None
    finally:
        gateway.stop()
        recorder.stop()


def test_unknown_dispatch_is_refused(registry):
    with pytest.raises(ValueError, match="--dispatch must be one of"):
        GatewayThread(registry, dispatch="random")
    with pytest.raises(ValueError, match="--max-attempts must be at least 1"):
        GatewayThread(registry, max_attempts=0)


class DyingDecodeInstance(StandIn):
    """A decode instance that streams two chunks, then drops the connection."""

    route = ("/pd/decode", "_die")

    async def _die(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b"):
            await response.write(b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\n'
                                 % text.encode())
        await asyncio.sleep(0.05)
        request.transport.close()
        return response

    def instance(self) -> Instance:
        return Instance("dying", SCENARIO, "decode", f"127.0.0.1:{self.port}",
                        "127.0.0.1:1", "tiny")


def test_decode_instance_dying_mid_stream_with_none_left_ends_the_stream_with_an_error(
        instances):
    dying = DyingDecodeInstance()
    registry = MemoryRegistry()
    registry.register(_instance(instances[0], "prefill"))
    registry.register(dying.instance())
    gateway = GatewayThread(registry)
    try:
        status, _, raw = gateway.http.request("POST", "/v1/completions", {**BODY, "stream": True})
        events = [line for line in raw.decode().split("\n\n") if line]
        assert status == 200 and len(events) == 4, raw
        error = json.loads(events[2].removeprefix("data: "))["error"]
        # no other decode instance to resume on: the stream ends, saying why
        assert "no decode instance" in error["message"] and events[3] == "data: [DONE]"
        # the gateway skips it now rather than sending it more answers to lose
        status, _, _ = gateway.http.request("POST", "/v1/completions", BODY)
        assert status == 503
    finally:
        gateway.stop()
        dying.stop()
        registry.close()


def test_client_hanging_up_frees_the_request_on_both_instances(instances, gateway):
    async def open_and_drop() -> None:
        import aiohttp

        body = {**BODY, "max_tokens": 3000, "stream": True, "prompt": "A long story"}
        async with aiohttp.ClientSession() as session:
            async with session.post(gateway.http.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # decoding has started on the decode instance

    start = time.monotonic()
    asyncio.run(open_and_drop())
    for server in instances:
        wait_engine_idle(server)
    assert time.monotonic() - start < 20  # 3000 tokens would take minutes on a CPU


def test_logprobs_stop_strings_and_cached_tokens_cross_the_split(instances, gateway):
    body = {**BODY, "logprobs": 0, "max_tokens": 12}
    alone = _complete(instances[0], body)["choices"][0]
    split = _complete(gateway.http, body)["choices"][0]
    assert split["text"] == alone["text"]
    got, want = split["logprobs"]["token_logprobs"], alone["logprobs"]["token_logprobs"]
    assert got == pytest.approx(want, abs=1e-4)  # the first one came from the prefill side
    stop = alone["text"][3:5]
    cut = _complete(gateway.http, {**BODY, "stop": [stop]})["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == alone["text"][: alone["text"].index(stop)]
    long_prompt = {**BODY, "prompt": "shared system prompt " * 20 + "question one"}
    _complete(gateway.http, long_prompt)
    again = _complete(gateway.http, {**long_prompt, "prompt": long_prompt["prompt"] + " two"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefill side's cache


def test_the_responses_api_through_the_gateway_is_an_instances(instances, gateway):
    """/v1/responses through the gateway runs as a P/D chat: whole, streamed (every event as
    the openai package reads it) and continued, the same answers one instance gives."""
    from tests.server.test_responses import EVENTS, WEATHER, _validate, wait_for

    fields = {"model": "tiny", "input": "Say something", "temperature": 0.0,
              "max_output_tokens": 10, "instructions": "Be terse",
              "extra_body": {"ignore_eos": True}}
    alone = instances[0].openai().responses.create(**fields, store=False)
    split = gateway.http.openai().responses.create(**fields, metadata={"via": "gateway"})
    assert split.output_text == alone.output_text and split.status == "incomplete"
    assert split.usage.input_tokens == alone.usage.input_tokens
    assert split.usage.output_tokens == 10
    events = list(gateway.http.openai().responses.create(**fields, store=False, stream=True))
    for event in events:
        _validate(EVENTS[event.type], event.model_dump(exclude_unset=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        alone.output_text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 10
    continued = gateway.http.openai().responses.create(
        **{**fields, "input": "More"}, previous_response_id=split.id)
    chat = instances[0].openai().chat.completions.create(
        model="tiny", temperature=0.0, max_tokens=10, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Be terse"},
                  {"role": "user", "content": "Say something"},
                  {"role": "assistant", "content": split.output_text},
                  {"role": "user", "content": "More"}])
    assert continued.output_text == chat.choices[0].message.content
    assert gateway.http.openai().responses.retrieve(split.id).metadata == {"via": "gateway"}
    queued = gateway.http.openai().responses.create(**fields, background=True)
    assert queued.status == "queued"
    assert wait_for(gateway.http.openai(), queued.id).output_text == alone.output_text
    called = gateway.http.openai().responses.create(
        model="tiny", input="Weather?", max_output_tokens=80, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        extra_body={"seed": 1, "logit_bias": {str(ord('"')): 5}})
    assert called.output[0].type == "function_call"
    assert json.loads(called.output[0].arguments).keys() == {"city"}
    status, _, raw = gateway.http.request("POST", "/v1/responses", {
        "model": "tiny", "input": "x", "max_output_tokens": 10 ** 7})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_output_tokens"


def test_a_reasoning_models_thought_crosses_the_split_and_resumes_where_it_broke():
    """P/D instances with --reasoning-parser: the chat through the gateway splits the
    thought as one instance does (the tiny model never closes it: all reasoning), and a
    decode instance resuming after some tokens sends exactly the thought's rest, its chunks
    counting the model's own characters (what the gateway adds up to resume after)."""
    flags = ("--kv-transfer-port", "0", "--reasoning-parser", "deepseek_r1")
    prefill, decode = start_servers(flags, flags)
    registry = MemoryRegistry()
    gateway = None
    try:
        registry.register(_instance(prefill, "prefill"))
        registry.register(_instance(decode, "decode"))
        gateway = GatewayThread(registry)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Think"}],
                "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        status, _, raw = prefill.request("POST", "/v1/chat/completions", chat)
        want = json.loads(raw)["choices"][0]["message"]["reasoning"]
        stream = gateway.http.openai().chat.completions.create(
            stream=True, **{k: v for k, v in chat.items() if k != "ignore_eos"},
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        chunks = list(stream)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == want
        assert not any(d.content for d in deltas)
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 24
        thought = gateway.http.openai().responses.create(  # counted by the instance
            model="tiny", input="Think", temperature=0.0, max_output_tokens=24,
            extra_body={"ignore_eos": True})
        assert thought.usage.output_tokens_details.reasoning_tokens == 24
        assert [item.type for item in thought.output] == ["reasoning"]  # the whole answer's
        assert thought.output[0].content[0].text == want
        ids, _ = asyncio.run(_pd_chat(prefill, decode, chat, [], 0))
        for chars in (0, 5, len(want) // 2):
            rest, counts = asyncio.run(_pd_chat(prefill, decode, chat, ids[:8], chars))
            assert rest == want[chars:] and sum(counts) == len(want) - chars
    finally:
        if gateway is not None:
            gateway.stop()
        registry.close()
        stop_servers((prefill, decode))


async def _pd_chat(prefill: Server, decode: Server, chat: dict, resume_ids: list[int],
                   resume_chars: int):
    """A chat stream from the internal routes: its token ids and no resume; with a resume,
    its reasoning text and each chunk's count of the model's characters."""
    import aiohttp

    request = {**chat, "stream": True}
    kv_target = json.loads(decode.request("GET", "/pd/info")[2])["kv_address"]
    offer = {"kind": "chat", "request": request, "kv_target": kv_target,
             "transfer_id": f"r{len(resume_ids)}-{resume_chars}", "resume_token_ids": resume_ids}
    async with aiohttp.ClientSession() as session:
        async with session.post(prefill.url + "/pd/prefill", json=offer) as resp:
            first = await resp.json()
        ask = {"kind": "chat", "request": request, "transfer_id": offer["transfer_id"],
               "first_token": first["first_token"], "resume_token_ids": resume_ids,
               "resume_text_chars": resume_chars}
        ids, text, counts = [], "", []
        async with session.post(decode.url + "/pd/decode", json=ask) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    ids += chunk.get("pdserve_token_ids", [])
                    counts.append(chunk.get("pdserve_text_chars", 0))
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("reasoning") or ""
    return (ids, counts) if not resume_ids else (text, counts)


STREAMED_WITH_USAGE = {**BODY, "stream": True, "stream_options": {"include_usage": True}}


def _events(raw: bytes) -> list:
    lines = [line.removeprefix(b"data:").strip() for line in raw.split(b"\n")]
    return [p if p == b"[DONE]" else json.loads(p) for p in lines if p]


def test_a_decode_instance_s_finish_chunk_names_the_usage_its_answer_ends_with(
        multiplex_decode):
    """On the internal route the chunk with the finish reason also carries the answer's
    usage (``pdserve_usage``), which the gateway needs if the instance fails before its
    usage chunk."""
    body = {"kind": "completions", "request": STREAMED_WITH_USAGE, "prefill_here": True}
    status, _, raw = multiplex_decode.request("POST", "/pd/decode", body)
    assert status == 200, raw
    events = _events(raw)
    finish = [e for e in events[:-2] if e["choices"] and e["choices"][0]["finish_reason"]]
    usage_chunk = events[-2]
    assert events[-1] == b"[DONE]" and usage_chunk["choices"] == []
    assert len(finish) == 1 and finish[0]["pdserve_usage"] == usage_chunk["usage"]
    assert usage_chunk["usage"]["completion_tokens"] == BODY["max_tokens"]


class CutAfterFinish(StandIn):
    """A multiplexing decode instance that streams a whole answer, its finish reason
    included, and dies before its usage chunk and [DONE]."""

    route = ("/pd/decode", "_answer_then_die")
    USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 0}}

    async def _answer_then_die(self, request: web.Request) -> web.StreamResponse:
        self.offers += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "cmpl-cut", "object": "text_completion", "created": 1, "model": "tiny",
                 "choices": [{"index": 0, "text": " jumps over", "logprobs": None,
                              "finish_reason": "length"}],
                 "usage": None, "pdserve_token_ids": [11, 12], "pdserve_usage": self.USAGE}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        request.transport.close()  # killed: no usage chunk, no [DONE]
        return response

    def instance(self) -> Instance:
        return Instance("cut", SCENARIO, "decode", f"127.0.0.1:{self.port}", "127.0.0.1:1",
                        "tiny", schedule="multiplex")


def test_an_answer_whose_instance_died_after_its_last_token_still_ends_with_its_usage():
    """Every token is out, so nothing is resumed; the gateway ends the stream itself, with
    the usage chunk the client asked for (as the chaos test once found missing)."""
    cut = CutAfterFinish()
    registry = MemoryRegistry()
    registry.register(cut.instance())
    gateway = GatewayThread(registry)
    try:
        status, _, raw = gateway.http.request("POST", "/v1/completions",
                                              {**STREAMED_WITH_USAGE, "max_tokens": 2})
        assert status == 200
        events = _events(raw)
        assert [e["choices"][0]["text"] for e in events[:1]] == [" jumps over"]
        assert events[1] == {"id": "cmpl-cut", "object": "text_completion", "created": 1,
                             "model": "tiny", "choices": [], "usage": CutAfterFinish.USAGE}
        assert events[2:] == [b"[DONE]"] and cut.offers == 1
        assert all("pdserve_usage" not in e for e in events[:2])
    finally:
        gateway.stop()
        cut.stop()
        registry.close()
