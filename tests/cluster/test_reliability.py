"""Nothing lost in a P/D group: real `pdserve serve` processes (tiny model, CPU), KV over real
TCP, the gateway over real HTTP; instances frozen (SIGSTOP) to catch them mid-work, then
killed (SIGKILL) or their KV corrupted on the way. Every answer must equal the fault-free one
(greedy)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading

import aiohttp
import pytest

from pdserve.cluster.registry import Instance, MemoryRegistry
from tests.cluster.group import (
    SCENARIO,
    SECRET,
    Group,
    freeze,
    kill,
    listing,
    pd_info,
    start_group,
    stream,
    thaw,
    wait_until,
)
from tests.cluster.test_pd_e2e import GatewayThread
from tests.server.conftest import free_port, wait_engine_idle

pytestmark = pytest.mark.slow

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24,
              "temperature": 0, "ignore_eos": True}
# Long enough that a kill after a few chunks lands mid-answer (the test checks that it did).
LONG_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell a long story."}],
             "max_tokens": 64, "temperature": 0, "ignore_eos": True,
             "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def group():
    # No refusals: the spread test must see where the gateway places work, not admission.
    group = start_group(ttft_slo_ms=1e6)
    yield group
    group.close()


@pytest.fixture(scope="module")
def reference(group):
    """Fault-free answers, through the same gateway."""
    answers = {}
    for name, body in (("completion", COMPLETION), ("chat", LONG_CHAT)):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, _, raw = group.gateway.http.request("POST", path, body)
        assert status == 200, raw
        answers[name] = json.loads(raw)
    return answers


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _in_background(coro_factory):
    """Runs a coroutine on its own loop in a thread; returns a function that joins it."""
    result = {}

    def run() -> None:
        result["value"] = asyncio.run(coro_factory())

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join(120)
        return result["value"]

    return join


async def _complete(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json()


def test_a_burst_spreads_evenly_over_prefill_and_decode_instances(group, reference):
    """Eight requests at once, every instance frozen until the gateway has placed all of
    them: each prefill and each decode instance gets four."""
    members = group.members
    accepted = {n: pd_info(members[n])["accepted"] for n in ("p0", "p1")}
    received = {n: wait_engine_idle(members[n])["pdserve_kv_transfers_total"]
                for n in ("d0", "d1")}
    for server in members.values():
        freeze(server)
    gateway = group.gateway

    async def burst() -> list[tuple[int, dict]]:
        return await asyncio.gather(*[_complete(gateway.http.url, COMPLETION)
                                      for _ in range(8)])

    join = _in_background(burst)
    try:
        wait_until(lambda: sum(gateway.gateway.prefill_load.values()) == 8)
        assert dict(gateway.gateway.decode_load) == {"d0": 4, "d1": 4}
        assert dict(gateway.gateway.prefill_load) == {"p0": 4, "p1": 4}
    finally:
        for server in members.values():
            thaw(server)
    answers = join()
    assert [status for status, _ in answers] == [200] * 8
    assert {_text(a) for _, a in answers} == {_text(reference["completion"])}
    assert {n: pd_info(members[n])["accepted"] - accepted[n] for n in accepted} == \
        {"p0": 4, "p1": 4}
    assert {n: wait_engine_idle(members[n])["pdserve_kv_transfers_total"] - received[n]
            for n in received} == {"d0": 4, "d1": 4}


def test_prefill_instance_killed_mid_prefill_only_delays_the_answer(group, reference):
    before = group.retries("prefill")
    freeze(group.members["p0"])  # it takes the offer (the kernel accepts) and stalls
    gateway = group.gateway
    join = _in_background(lambda: _complete(gateway.http.url, COMPLETION))
    wait_until(lambda: gateway.gateway.prefill_load["p0"] == 1)
    kill(group.members["p0"])
    status, answer = join()
    group.remove("p0")
    assert status == 200, answer
    assert _text(answer) == _text(reference["completion"])
    for count in ("prompt_tokens", "completion_tokens"):  # cached_tokens: p1's own cache
        assert answer["usage"][count] == reference["completion"]["usage"][count]
    assert group.retries("prefill") == before + 1


def test_decode_instance_killed_mid_stream_resumes_on_another(group, reference):
    """The chat stream goes on from another decode instance: the same text (greedy), one
    stream id, one role delta, the original prompt's usage."""
    before = group.retries("resume")
    want = reference["chat"]

    async def run():
        async with aiohttp.ClientSession() as session:
            return await stream(session, group.gateway.http.url, LONG_CHAT, after_chunks=5,
                                on_chunks=lambda: kill(group.members["d0"]))

    got = asyncio.run(run())
    group.remove("d0")
    assert got.status == 200 and got.error is None and got.done
    assert got.text == _text(want)
    assert len(got.ids) == 1 and got.roles == 1
    assert got.usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got.usage["completion_tokens"] == LONG_CHAT["max_tokens"]
    assert group.retries("resume") == before + 1


def test_a_fanned_out_streams_part_resumes_alone_when_its_decode_instance_dies(group,
                                                                              reference):
    """n = 2 through the gateway: a P/D request per choice, one on each decode instance;
    killing one mid-answer resumes its part on the other, and the client's one stream
    still carries both choices whole (greedy: each the reference text), under one id."""
    group.add("d2", "decode")
    wait_until(lambda: "d2" in group.roles)
    before = group.retries("resume")
    body = {**LONG_CHAT, "n": 2, "stream": True}

    async def run() -> tuple[int, dict[int, str], set[str], dict | None, bool]:
        texts: dict[int, str] = {0: "", 1: ""}
        ids, usage, done, chunks = set(), None, False, 0
        async with aiohttp.ClientSession() as session:
            async with session.post(group.gateway.http.url + "/v1/chat/completions",
                                    json=body) as resp:
                async for line in resp.content:
                    payload = line.removeprefix(b"data: ").strip()
                    if payload == b"[DONE]":
                        done = True
                    elif payload.startswith(b"{"):
                        chunk = json.loads(payload)
                        assert "error" not in chunk, chunk
                        ids.add(chunk["id"])
                        usage = chunk.get("usage") or usage
                        for choice in chunk["choices"]:
                            texts[choice["index"]] += choice["delta"].get("content") or ""
                        chunks += 1
                        if chunks == 12:
                            await asyncio.get_running_loop().run_in_executor(
                                None, kill, group.members["d2"])
                return resp.status, texts, ids, usage, done

    status, texts, ids, usage, done = asyncio.run(run())
    group.remove("d2")
    want = _text(reference["chat"])
    assert status == 200 and done and texts == {0: want, 1: want} and len(ids) == 1
    assert usage["prompt_tokens"] == reference["chat"]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 2 * LONG_CHAT["max_tokens"]
    assert group.retries("resume") == before + 1


class CorruptingProxy:
    """Forwards KV connections to a receiver, flipping one bit in the first buffer's
    payload: what a faulty link would do."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.corrupted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(self.target) as out:
            prefix = _read(conn, 8)
            header = _read(conn, struct.unpack(">I", prefix[4:])[0])
            first = bytearray(_read(conn, 16))
            first[3] ^= 0x10
            self.corrupted += 1
            out.sendall(prefix + header + bytes(first))
            while data := conn.recv(1 << 16):
                out.sendall(data)

    def close(self) -> None:
        self.listener.close()


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def test_kv_corrupted_on_the_way_is_never_decoded_and_the_stream_resumes(group, reference):
    """The decode instance listed as "d-corrupt" gets its KV through a bit-flipping link:
    it drops the buffer (checksum), fails that request at once (often before its first
    token reached the client), and the gateway runs it again on "d1" (the same process,
    reached directly)."""
    d1 = group.members["d1"]
    proxy = CorruptingProxy(pd_info(d1)["kv_address"])
    group.registry.register(listing(d1, "decode", "d-corrupt", kv=proxy.address))
    before = group.retries("resume") + group.retries("prefill")
    try:
        async def run():
            async with aiohttp.ClientSession() as session:
                return await stream(session, group.gateway.http.url, LONG_CHAT)

        got = asyncio.run(run())
    finally:
        group.registry.unregister("d-corrupt")
        proxy.close()
    assert proxy.corrupted == 1
    assert got.status == 200 and got.error is None and got.done
    assert got.text == _text(reference["chat"])
    assert got.usage["completion_tokens"] == LONG_CHAT["max_tokens"]
    assert group.retries("resume") + group.retries("prefill") == before + 1
    assert "do not match the sender's checksum" in d1.log_text()


def _dead(role: str, name: str) -> Instance:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    return Instance(name, SCENARIO, role, address, address, "tiny")


@pytest.mark.parametrize("dead_role", ["prefill", "decode"])
def test_no_live_instance_of_a_role_is_a_retryable_503(group, dead_role):
    registry = MemoryRegistry()
    registry.register(_dead(dead_role, f"dead-{dead_role}"))
    live = ("decode", "d1") if dead_role == "prefill" else ("prefill", "p1")
    registry.register(listing(group.members[live[1]], *live))
    gateway = GatewayThread(registry, cluster_secret=SECRET)
    try:
        status, headers, raw = gateway.http.request("POST", "/v1/completions", COMPLETION)
    finally:
        gateway.stop()
        registry.close()
    assert status == 503 and headers["Retry-After"] == "1"
    message = json.loads(raw)["error"]["message"]
    assert f"no {dead_role} instance" in message and "1 listed" in message


def test_internal_routes_need_the_cluster_secret_not_an_api_key(group):
    server = group.members["d1"]
    assert server.request("GET", "/pd/info")[0] == 401
    bearer = {"Authorization": f"Bearer {SECRET}"}
    assert server.request("GET", "/pd/info", headers=bearer)[0] == 401
    wrong = {"X-PDServe-Cluster-Secret": SECRET + "x"}
    status, _, raw = server.request("POST", "/pd/prefill", b"{}", headers=wrong)
    assert status == 401 and b"cluster secret" in raw
    assert pd_info(server)["model"] == "tiny"
    for member in group.members.values():
        assert SECRET not in member.log_text()


async def _internal_answer(group: Group, resume_ids: list[int], resume_chars: int,
                           chat: dict | None = None) -> tuple[str, list[int]]:
    """A chat stream straight from p1 and d1's internal routes: its text and token ids."""
    p1, d1 = group.members["p1"], group.members["d1"]
    headers = {"X-PDServe-Cluster-Secret": SECRET}
    request = {**(chat or LONG_CHAT), "stream": True}
    offer = {"kind": "chat", "request": request, "transfer_id": f"t{len(resume_ids)}",
             "kv_target": pd_info(d1)["kv_address"], "resume_token_ids": resume_ids}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(p1.url + "/pd/prefill", json=offer) as resp:
            first = await resp.json()
        ask = {"kind": "chat", "request": request, "transfer_id": offer["transfer_id"],
               "first_token": first["first_token"], "resume_token_ids": resume_ids,
               "resume_text_chars": resume_chars}
        text, ids = "", []
        async with session.post(d1.url + "/pd/decode", json=ask) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    ids += chunk.get("pdserve_token_ids", [])
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("content") or ""
    return text, ids


def test_a_resumed_answer_sends_exactly_the_text_the_client_lacks(group, reference):
    """Resumed after 10 tokens, whatever part of the text the client holds (it depends on
    where the failed instance's detokenizer held text back): the new instance sends exactly
    the rest, and the token ids go on where they stopped."""
    want = _text(reference["chat"])
    text, ids = asyncio.run(_internal_answer(group, [], 0))
    assert text == want and len(ids) == LONG_CHAT["max_tokens"]
    # Fewer characters than 10 tokens make (the rest of theirs goes first) or more (the
    # coming text is cut by the difference): either way exactly the rest of the answer.
    for chars in (0, 3, len(want) // 3, len(want) // 2):
        text, rest = asyncio.run(_internal_answer(group, ids[:10], chars))
        assert text == want[chars:] and rest == ids[10:]


def test_a_resumed_echoed_answer_sends_the_echo_once(group):
    """Chat ``echo`` (the last message is the assistant's, continued): the first attempt
    sends it with the first token, and the characters the client holds count it; the
    resumed attempt sends only the output's rest."""
    echoed = {**LONG_CHAT, "echo": True, "add_generation_prompt": False,
              "continue_final_message": True,
              "messages": [*LONG_CHAT["messages"],
                           {"role": "assistant", "content": "Once upon"}]}
    want, ids = asyncio.run(_internal_answer(group, [], 0, echoed))
    assert want.startswith("Once upon") and len(ids) == LONG_CHAT["max_tokens"]
    for chars in (len("Once upon") + 2, len(want) // 2):
        text, rest = asyncio.run(_internal_answer(group, ids[:10], chars, echoed))
        assert text == want[chars:] and rest == ids[10:]


def test_a_responses_stream_resumes_when_its_decode_instance_dies(group, reference):
    """/v1/responses streamed through the gateway runs as a chat stream: killed mid-answer,
    it resumes on another decode instance inside the one Responses stream - the same text
    (greedy), events numbered without a gap, one response id, one resume."""
    group.add("d3", "decode")
    wait_until(lambda: "d3" in group.roles)
    before = group.retries("resume")
    body = {"model": "tiny", "input": LONG_CHAT["messages"][0]["content"], "temperature": 0,
            "max_output_tokens": LONG_CHAT["max_tokens"], "ignore_eos": True, "stream": True,
            "store": False}

    def kill_the_serving_decode_instance() -> None:
        load = group.gateway.gateway.decode_load
        name = next(name for name, role in group.roles.items() if role == "decode"
                    and load[name] > 0)
        kill(group.members[name])
        group.remove(name)

    async def run() -> tuple[int, list[dict]]:
        events = []
        async with aiohttp.ClientSession() as session:
            async with session.post(group.gateway.http.url + "/v1/responses",
                                    json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(json.loads(line.removeprefix(b"data: ")))
                        if len(events) == 12:
                            await asyncio.get_running_loop().run_in_executor(
                                None, kill_the_serving_decode_instance)
                return resp.status, events

    status, events = asyncio.run(run())
    assert status == 200 and events[-1]["type"] == "response.incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == _text(reference["chat"])
    assert events[-1]["response"]["usage"]["output_tokens"] == LONG_CHAT["max_tokens"]
    assert group.retries("resume") == before + 1
