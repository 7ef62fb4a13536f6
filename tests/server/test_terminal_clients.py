"""``pdserve chat`` and ``pdserve complete`` against a real server: each line one streamed
answer, the chat's conversation kept, a refused request reported and left out of it, the
first listed model picked, an unreachable server one line of error."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading

import pytest

from pdserve.cli import build_parser
from pdserve.client_cli import run_chat, run_complete
from pdserve.testing import free_port

openai = pytest.importorskip("openai")

GREEDY = ("--max-tokens", "6", "--temperature", "0")


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def _chat_answer(server, messages: list[dict]) -> str:
    return server.openai().chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0).choices[0].message.content


def test_chat_keeps_the_conversation_and_streams_each_answer(server):
    out = io.StringIO()
    code = run_chat(_args("chat", "--url", server.url + "/v1", "--system-prompt", "Be brief",
                          *GREEDY), io.StringIO("Hello\n\nAnd again\n"), out)
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello"}]
    first = _chat_answer(server, messages)
    # the second request carried the first exchange: the answer asked with it
    second = _chat_answer(server, [*messages, {"role": "assistant", "content": first},
                                   {"role": "user", "content": "And again"}])
    # a prompt before each line read (the empty one sends nothing), a newline at the end
    assert code == 0 and out.getvalue() == f"> {first}\n> > {second}\n> \n"


def test_complete_answers_each_line_as_a_prompt(server):
    out = io.StringIO()
    code = run_complete(_args("complete", "--url", server.url + "/v1", *GREEDY),
                        io.StringIO("Once upon\n"), out)
    want = server.openai().completions.create(model="tiny", prompt="Once upon", max_tokens=6,
                                              temperature=0).choices[0].text
    assert code == 0 and out.getvalue() == f"> {want}\n> \n"


def test_a_refused_request_is_reported_and_left_out_of_the_conversation(server):
    limit = json.loads(server.request("GET", "/v1/models")[2])["data"][0]["max_model_len"]
    out = io.StringIO()
    code = run_chat(_args("chat", "--url", server.url + "/v1", *GREEDY),
                    io.StringIO("word " * (limit + 10) + "\nhi\n"), out)
    refused, answered, end = out.getvalue().split("> ")[1:]
    assert code == 0 and refused.startswith("error: 400: ") and "token" in refused
    # the next line is sent alone: the refused message is not in the conversation
    assert answered == _chat_answer(server, [{"role": "user", "content": "hi"}]) + "\n"
    assert end == "\n"
    quick = run_complete(_args("complete", "--url", server.url + "/v1", "--model-name",
                               "not-served", "-q", "x"), io.StringIO(), io.StringIO())
    assert quick == 1


def test_quick_answers_once_through_the_command_line(server):
    done = subprocess.run([sys.executable, "-m", "pdserve", "complete", "--url",
                           server.url + "/v1", *GREEDY, "-q", "Once upon"],
                          capture_output=True, text=True, timeout=60)
    want = server.openai().completions.create(model="tiny", prompt="Once upon", max_tokens=6,
                                              temperature=0).choices[0].text
    assert done.returncode == 0 and done.stdout == want + "\n"


def test_a_url_without_the_api_base_gets_the_404_and_a_hint(server):
    done = subprocess.run([sys.executable, "-m", "pdserve", "chat", "--url", server.url,
                           "-q", "hi"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("pdserve: error: 404")
    assert f"did you mean {server.url}/v1?" in done.stderr


def test_an_unreachable_server_is_one_line_of_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    done = subprocess.run([sys.executable, "-m", "pdserve", "chat", "--url", url, "-q", "hi"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.startswith("pdserve: error: cannot reach") and "Traceback" not in \
        done.stderr


def test_an_answer_that_breaks_off_is_reported_and_the_session_goes_on():
    """A server that starts a streamed answer and closes the connection mid-way."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_broken_answers() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                chunk = b'data: {"choices": [{"index": 0, "text": "Half"}]}\n\n'
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    thread = threading.Thread(target=serve_broken_answers, daemon=True)
    thread.start()
    out = io.StringIO()
    code = run_complete(_args("complete", "--url", f"http://127.0.0.1:{port}/v1",
                              "--model-name", "m"), io.StringIO("one\ntwo\n"), out)
    thread.join(timeout=30)
    listener.close()
    lines = out.getvalue().split("\n")
    assert code == 0 and lines[0] == "> Half" and lines[1].startswith("error: the answer from")
    assert lines[2] == "> Half" and lines[4] == "> "  # the second line was still sent
