"""Fuzzing one real ``pdserve serve tiny`` with hypothesis: OpenAI request bodies (every field
the server knows, unknown ones, wrong types, huge and negative numbers, unicode, nested junk)
and raw malformed HTTP (bad request lines, bad JSON, truncated bodies, wrong content types,
wrong methods and paths).

Every answer must be: no 5xx (none is documented for a healthy engine), every 4xx the app
answers in the OpenAI error shape, every 200 a whole answer; and afterwards the server is
healthy and the engine idle with every KV page free. Only requests that malform HTTP itself
are answered by aiohttp's parser before the app runs: a plain-text 400 (docs/server.md).

``PDSERVE_FUZZ_SCALE`` (default 1) multiplies the number of examples (about 5,400 at 1; a
deeper run: 4 or more).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from tests.server.conftest import wait_engine_idle

pytestmark = pytest.mark.slow

SCALE = float(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))
VOCAB = 512  # past the tiny model's vocabulary too
BATCH = 8
# Per route (1,200 OpenAI bodies each): these batches of generations are most of the module's
# time, and the bugs they found have their own tests (test_numbers_past_int64_...).
BODY_BATCHES = 150
TALLY: Counter = Counter()  # answers by (route kind, status), over the whole module


def _settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=True,
                    database=None)


@pytest.fixture(scope="module")
def target(launch):
    # A short body timeout: a body announced longer than it is gets its 408 soon. One torch
    # thread: on a 2-core host shared with this test's clients, torch's default pool of two
    # made the engine's steps stall for seconds at a time (see benchmarks/soak.py).
    server = launch("--num-blocks", "512", "--max-num-seqs", "32", "--max-model-len", "512",
                    "--body-timeout-s", "2", env={"OMP_NUM_THREADS": "1"})
    yield server
    print("\nfuzz answers:", dict(sorted(TALLY.items(), key=str)), "total", sum(TALLY.values()))


@pytest.fixture(scope="module")
def conn(target):
    connection = _Connection(target.port)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def clients(target):
    """Sends a batch of bodies at once, one keep-alive connection per thread: the ones that
    reach the engine run in one batch instead of one after another."""
    local = threading.local()

    def post(path: str, body) -> tuple[int, dict[str, str], bytes]:
        if not hasattr(local, "conn"):
            local.conn = _Connection(target.port)
        return local.conn.send("POST", path, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})

    with ThreadPoolExecutor(BATCH) as pool:
        yield lambda path, batch: list(pool.map(lambda body: post(path, body), batch))


# ---- strategies ---------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
           | st.text(max_size=24))
# Two levels of nesting, spelled out: st.recursive cost half of the whole run's drawing.
NESTED = st.lists(SCALARS, max_size=4) | st.dictionaries(st.text(max_size=8), SCALARS,
                                                         max_size=4)
JUNK = SCALARS | NESTED | st.lists(NESTED, max_size=3) | st.dictionaries(
    st.text(max_size=8), NESTED, max_size=3)
SMALL_COUNT = st.integers(1, 4) | st.integers(-3, 4) | st.sampled_from([2**31, 2**63, 10**30,
                                                                        -(2**63)])
TEXT = st.text(max_size=40)
TOKEN_IDS = st.lists(st.integers(0, 255), min_size=1, max_size=24) | st.lists(
    st.integers(-5, VOCAB), max_size=24)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", ""])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": TEXT})
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": TEXT | st.lists(PART, max_size=2)
                                 | st.none() | JUNK})
PLAUSIBLE = {
    "model": st.sampled_from(["tiny"] * 6 + ["gpt-4", ""]),
    "prompt": st.text(min_size=1, max_size=40) | TEXT | TOKEN_IDS | st.lists(TEXT, max_size=2)
    | st.lists(TOKEN_IDS, max_size=2),
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}),
                         min_size=1, max_size=2) | st.lists(MESSAGE, max_size=3),
    "max_tokens": SMALL_COUNT,
    "max_completion_tokens": SMALL_COUNT,
    "min_tokens": SMALL_COUNT,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "temperature": st.floats(-1, 3) | st.sampled_from([0, 1e308, float("nan")]),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 600),
    "seed": st.integers(-2**65, 2**65),
    "stop": TEXT | st.lists(TEXT, max_size=20),
    "stop_token_ids": TOKEN_IDS,
    "logprobs": st.booleans() | st.integers(-1, 3),
    "echo": st.booleans(),
    "n": st.integers(-1, 3),
    **dict.fromkeys(("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "add_special_tokens", "return_engine_timing", "add_generation_prompt",
                     "continue_final_message"), st.booleans()),
    "chat_template": TEXT | st.sampled_from(["{{ messages }}", "{% for m in messages %}",
                                             "{{ ''.__class__.__mro__ }}"]),
    "chat_template_kwargs": st.dictionaries(TEXT, JUNK, max_size=2),
    "user": TEXT,
}


def _field_strategy(name: str) -> st.SearchStrategy:
    plausible = PLAUSIBLE.get(name, st.none())  # null: the off value of every refused field
    return st.one_of(*[plausible] * 8, JUNK)  # mostly plausible, some junk


# About one draw in 20 (st.integers would favour its bounds, so a list of outcomes).
RARELY = st.sampled_from([False] * 19 + [True])
FIELD_VALUES = {name: _field_strategy(name) for name in {*COMPLETION_FIELDS, *CHAT_FIELDS}}


@st.composite
def bodies(draw, fields: dict, chat: bool):
    """A request body: a few of the route's fields (plausible values more often than
    junk), sometimes an unknown field, sometimes not an object at all."""
    if draw(RARELY):
        return draw(JUNK)
    body = {"model": draw(FIELD_VALUES["model"])}
    body["messages" if chat else "prompt"] = draw(FIELD_VALUES["messages" if chat else "prompt"])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        body[name] = draw(FIELD_VALUES[name])
    if draw(RARELY):
        body[draw(st.text(min_size=1, max_size=12))] = draw(JUNK)
    # Without a small limit a chat answer runs to the end of the context: bound what
    # reaches the engine (the limit itself is fuzzed above; an explicit null is not).
    if chat and not isinstance(body.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = 2
    elif not chat and body.get("max_tokens") is None:
        body["max_tokens"] = 2
    return body


# ---- HTTP ---------------------------------------------------------------------------------


class _Connection:
    """One keep-alive connection, opened again whenever the server closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.http: http.client.HTTPConnection | None = None

    def send(self, method: str, path: str, body: bytes | None,
             headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        if self.http is None:
            self.http = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            self.http.request(method, path, body=body, headers=headers)
            response = self.http.getresponse()
            answer = response.status, {k.lower(): v for k, v in response.getheaders()}, \
                response.read()
        except (http.client.RemoteDisconnected, ConnectionError):
            self.close()  # an idle keep-alive connection the server closed: once more
            return self.send(method, path, body, headers)
        if answer[1].get("connection", "").lower() == "close":
            self.close()
        return answer

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None


def _check(kind: str, status: int, headers: dict[str, str], body: bytes) -> None:
    TALLY[kind, status] += 1
    assert status < 500, (status, body[:500])
    if status >= 400:
        _check_error_shape(headers, body)
    elif status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        _check_stream(body)
    elif status == 200 and kind != "get":
        assert json.loads(body)["choices"], body[:500]


def _check_error_shape(headers: dict[str, str], body: bytes) -> None:
    assert headers.get("content-type", "").startswith("application/json"), body[:300]
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"], body[:300]
    assert isinstance(error["type"], str) and "param" in error and "code" in error


def _check_stream(body: bytes) -> None:
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]", body[-300:]
    for event in events[:-1]:
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, event  # a healthy engine fails no request midway


def _post_json(conn: _Connection, kind: str, path: str, body) -> None:
    raw = json.dumps(body).encode()  # NaN and Infinity stay in: junk a client may send
    _check(kind, *conn.send("POST", path, raw, {"Content-Type": "application/json"}))


# ---- the OpenAI request space -------------------------------------------------------------


# A batch of bodies per example, sent at once (hypothesis also spends less per body drawn
# in a batch).
@_settings(BODY_BATCHES)
@given(batch=st.lists(bodies(COMPLETION_FIELDS, chat=False), min_size=BATCH, max_size=BATCH))
def test_fuzz_completions(clients, batch):
    for answer in clients("/v1/completions", batch):
        _check("completions", *answer)


@_settings(BODY_BATCHES)
@given(batch=st.lists(bodies(CHAT_FIELDS, chat=True), min_size=BATCH, max_size=BATCH))
def test_fuzz_chat(clients, batch):
    for answer in clients("/v1/chat/completions", batch):
        _check("chat", *answer)


@pytest.mark.parametrize("field, value, status", [
    ("seed", 2**64, 400), ("seed", -(2**63) - 1, 400), ("seed", 2**64 - 1, 200),
    ("top_k", 2**70, 200)])
def test_numbers_past_int64_are_refused_or_honoured(conn, field, value, status):
    """Found by the fuzzing above: a seed past 64 bits answered 500 (the engine's generator
    raised), a top_k past int64 failed the whole launch (every request batched with it)."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, field: value}
    answer = conn.send("POST", "/v1/completions", json.dumps(body).encode(),
                       {"Content-Type": "application/json"})
    _check("completions", *answer)
    assert answer[0] == status, answer[2]


# ---- malformed HTTP -----------------------------------------------------------------------

PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models",
                         "/v1/nope", "/", "/health/../v1/completions", "/v1/completions?x=%ff"])
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "multipart/form-data",
                                 "application/x-www-form-urlencoded", "application/json; "
                                 "charset=latin-1", "", "*/*"])
GOOD = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()


@_settings(1500)
@given(path=PATHS, content_type=CONTENT_TYPES,
       payload=st.binary(max_size=64) | st.builds(lambda cut: GOOD[:cut], st.integers(0, 40))
       | st.text(max_size=40).map(str.encode) | st.just(GOOD))
def test_fuzz_bodies_types_and_paths(conn, path, content_type, payload):
    """Bad JSON, bodies cut short (announced at their cut length), wrong content types,
    unknown paths: the app answers each, in the OpenAI shape when it refuses."""
    headers = {"Content-Type": content_type} if content_type else {}
    _check("raw-body", *conn.send("POST", path, payload, headers))


@_settings(400)
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=PATHS | st.text(alphabet="/abcv1%?=.", max_size=24).map(lambda p: "/" + p))
def test_fuzz_methods(conn, method, path):
    status, headers, body = conn.send(method, path, None, {})
    kind = "get" if method in ("GET", "HEAD") and status == 200 else "method"
    if method == "HEAD":
        TALLY[kind, status] += 1  # a HEAD answer has no body to check
        assert status < 500
        return
    _check(kind, status, headers, body)


REQUEST_LINES = (st.binary(min_size=1, max_size=60)
                 | st.builds(lambda m, p, v: f"{m} {p} {v}".encode(errors="surrogateescape"),
                             st.text(max_size=8), st.text(max_size=20),
                             st.sampled_from(["HTTP/1.1", "HTTP/9.9", "HTP/1.1", ""])))


@_settings(1000)
@given(line=REQUEST_LINES)
def test_fuzz_request_lines(target, line):
    """Lines that are not HTTP never reach the app: aiohttp's parser answers 400 in plain
    text and closes, or the line is HTTP after all and the app answers it."""
    status, headers, body = _raw_exchange(target.port, line + b"\r\nHost: x\r\n\r\n")
    TALLY["request-line", status] += 1
    assert status is None or status < 500, body[:300]
    if status is not None and status >= 400 and \
            not headers.get("content-type", "").startswith("text/plain"):
        _check_error_shape(headers, body)


@_settings(60)
@given(cut=st.integers(0, len(GOOD) - 1), chunked=st.booleans())
def test_fuzz_bodies_that_stop_early(target, cut, chunked):
    """The body announced longer than what comes (or a chunked body never ended), then the
    client stops writing: no 5xx, and the server goes on."""
    if chunked:
        head = b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(GOOD) + GOOD[:cut]
    else:
        head = b"Content-Length: %d\r\n\r\n" % len(GOOD) + GOOD[:cut]
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, headers, body = _raw_exchange(target.port, request + head)
    TALLY["cut-body", status] += 1
    assert status is None or status < 500, body[:300]
    if status is not None and status >= 400:
        _check_error_shape(headers, body)


def _raw_exchange(port: int, data: bytes) -> tuple[int | None, dict[str, str], bytes]:
    """Sends raw bytes, stops writing, reads the answer until the server closes; status
    None when it closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    if not received:
        return None, {}, b""
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


# ---- afterwards ---------------------------------------------------------------------------


def test_after_fuzzing_the_server_is_healthy_and_no_page_leaked(target, conn):
    """Runs last in this module: every KV page is free again and a plain request works."""
    idle = wait_engine_idle(target, timeout=60)  # nothing running or waiting, usage 0
    assert idle["pdserve_kv_cache_free_blocks"] == 512
    assert target.request("GET", "/health")[0] == 200
    _post_json(conn, "completions", "/v1/completions", json.loads(GOOD))
    assert sum(TALLY.values()) >= int(5200 * SCALE), TALLY
    assert TALLY["completions", 200] + TALLY["chat", 200] > 0  # the engine did run some
