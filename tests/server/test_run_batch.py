"""``pdserve run-batch``: OpenAI batch lines answered offline by the real command, one
output line per input line in the input's order, bad lines answered with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.server.run_batch import (
    BATCH_URLS,
    LINE_ERROR,
    BatchLineError,
    OrderedWriter,
    read_line,
)

GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 6}


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run_batch(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "run-batch", "tiny", "--device",
                           "cpu", "-q", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def read_outputs(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines()]


@pytest.mark.parametrize(("text", "why"), [
    ("[1]", "not a JSON object"),
    ("{", "not JSON"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "'custom_id'"),
    (line("x", "/v1/audio/transcriptions", {}),
     "'url' '/v1/audio/transcriptions' is not one of"),
    (line("x", "/v1/completions", {}, method="PUT"), "'method' must be \"POST\""),
    (line("x", "/v1/completions", []), "'body' must be a JSON object"),
    (line("x", "/v1/completions", {"stream": True}), "'stream' is not supported"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {},
                 "extra": 1}), "unknown field 'extra'"),
])
def test_a_line_that_cannot_be_sent_names_why(text, why):
    with pytest.raises(BatchLineError, match="line 4") as caught:
        read_line(3, text)
    assert why in str(caught.value)


@pytest.mark.parametrize("url", BATCH_URLS)
def test_a_good_line_is_read_as_it_came(url):
    read = read_line(0, line("id-1", url, {"model": "tiny"}))
    assert (read.custom_id, read.url, read.body) == ("id-1", url, {"model": "tiny"})


@given(st.permutations(range(12)))
def test_output_lines_come_in_the_inputs_order_whatever_order_answers_come(order):
    written: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            written.append(text)

    writer = OrderedWriter(Sink())
    for index in order:
        writer.add(index, {"index": index})
    assert [json.loads(x)["index"] for x in written] == list(range(12))
    assert not writer.waiting


def test_every_line_answered_in_order_as_the_server_would(tmp_path):
    """Greedy answers equal the offline engine's; a refused body keeps the server's 400;
    lines that cannot be sent get an error line; nothing is dropped or reordered."""
    lines = [line("chat", "/v1/chat/completions",
                  {**GREEDY, "messages": [{"role": "user", "content": "hello"}]}),
             line("text", "/v1/completions", {**GREEDY, "prompt": "The sky is"}),
             "not json at all",
             line("bad-max", "/v1/completions", {**GREEDY, "prompt": "x", "max_tokens": 0}),
             line("resp", "/v1/responses", {"model": "tiny", "input": "hi",
                                            "max_output_tokens": 4, "temperature": 0}),
             line("text", "/v1/completions", {**GREEDY, "prompt": "again"})]
    lines += [line(f"many-{i}", "/v1/completions", {**GREEDY, "prompt": f"n {i}"})
              for i in range(10)]
    lines.append(line("emb", "/v1/embeddings", {"model": "tiny", "input": "The sky is"}))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n\n")  # a blank line is skipped, as JSONL allows
    result = run_batch("-i", str(source), "-o", str(target))
    assert result.returncode == 0, result.stderr
    out = read_outputs(target.read_text())
    assert [o["custom_id"] for o in out] == [
        "chat", "text", None, "bad-max", "resp", "text", *(f"many-{i}" for i in range(10)),
        "emb"]
    assert len({o["id"] for o in out}) == len(out)
    chat, text, not_json, bad, resp, twice = out[:6]
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["request_id"] == chat["response"]["body"]["id"]
    assert not_json["response"] is None
    assert not_json["error"] == {"code": LINE_ERROR, "message": not_json["error"]["message"]}
    assert "line 3 is not JSON" in not_json["error"]["message"]
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert resp["response"]["body"]["object"] == "response"
    assert "line 6: 'custom_id' 'text' is used by an earlier line" in twice["error"]["message"]
    # the model really ran: the greedy completion is the offline engine's
    from pdserve import LLM, SamplingParams

    llm = LLM(model="tiny", device="cpu")
    offline = llm.generate(["The sky is"],
                           SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert text["response"]["body"]["choices"][0]["text"] == offline
    embedding = out[-1]["response"]["body"]["data"][0]["embedding"]
    assert embedding == pytest.approx(llm.embed(["The sky is"])[0].outputs.embedding, abs=1e-5)
    assert all(o["response"]["status_code"] == 200 for o in out[6:])
    assert "17 line(s)" in result.stderr and "14 answered with 200, 3 not" in result.stderr


def test_stdin_to_stdout():
    result = run_batch("-i", "-", "-o", "-", stdin=line(
        "one", "/v1/completions", {**GREEDY, "prompt": "hi"}) + "\n")
    assert result.returncode == 0, result.stderr
    (out,) = read_outputs(result.stdout)
    assert out["custom_id"] == "one" and out["response"]["status_code"] == 200


class _Files(BaseHTTPRequestHandler):
    """GET serves the batch's input; PUT keeps what is sent."""

    served = b""
    received: list[bytes] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.served)))
        self.end_headers()
        self.wfile.write(self.served)

    def do_PUT(self) -> None:  # noqa: N802
        self.received.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_input_and_output_over_http():
    _Files.served = (line("u", "/v1/completions", {**GREEDY, "prompt": "x"}) + "\n").encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/batch.jsonl"
        result = run_batch("-i", url, "-o", url)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    (out,) = read_outputs(_Files.received[-1].decode())
    assert out["custom_id"] == "u" and out["response"]["status_code"] == 200


def test_a_missing_input_file_stops_before_the_model_loads(tmp_path):
    result = run_batch("-i", str(tmp_path / "absent.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert result.returncode == 2
    assert "--input-file" in result.stderr and "no such file" in result.stderr
    assert "model loaded" not in result.stderr
    (tmp_path / "in.jsonl").write_text("")
    result = run_batch("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "o.jsonl"))
    assert result.returncode == 2 and "cannot write in" in result.stderr


def test_a_batch_through_a_running_server_with_its_api_key(launch, tmp_path):
    """--server-url: the lines go to the server named (nothing loaded here), the key from
    $PDSERVE_API_KEY; a greedy answer equals the server's own."""
    server = launch(api_key="sk-batch")
    body = {**GREEDY, "prompt": "The sky is"}
    expected = server.openai().completions.create(**body).choices[0].text
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(line("r1", "/v1/completions", body) + "\n")
    command = [sys.executable, "-m", "pdserve", "run-batch", "-q", "-i", str(source), "-o",
               str(target), "--server-url", server.url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PDSERVE_API_KEY": "sk-batch"})
    assert result.returncode == 0, result.stderr
    (out,) = read_outputs(target.read_text())
    assert out["response"]["status_code"] == 200
    assert out["response"]["body"]["choices"][0]["text"] == expected
    assert "model loaded" not in result.stderr
    # without the key: the server's 401, written as that line's answer
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"})
    assert result.returncode == 0, result.stderr
    (out,) = read_outputs(target.read_text())
    assert out["response"]["status_code"] == 401


def test_engine_flags_with_a_server_url_are_refused(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("")
    for extra, flag in ((["tiny"], "MODEL"), (["--max-num-seqs", "4"], "--max-num-seqs")):
        result = subprocess.run([sys.executable, "-m", "pdserve", "run-batch", *extra, "-i",
                                 str(source), "-o", "-", "--server-url", "http://127.0.0.1:9"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and f"{flag} with --server-url" in result.stderr



class _Busy(BaseHTTPRequestHandler):
    """Answers 503 (Retry-After 0) to the first two POSTs, then 200."""

    posts = 0

    def do_POST(self) -> None:  # noqa: N802 - the http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        busy = type(self).posts <= 2
        body = json.dumps({"error": {"message": "busy"}} if busy else {"id": "cmpl-1"}).encode()
        self.send_response(503 if busy else 200)
        self.send_header("Retry-After", "0")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_busy_server_is_asked_again():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pdserve", "run-batch", "-q", "-i", "-", "-o", "-",
             "--server-url", f"http://127.0.0.1:{server.server_address[1]}"],
            input=line("b", "/v1/completions", {"prompt": "x"}) + "\n", capture_output=True,
            text=True, timeout=60)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    (out,) = read_outputs(result.stdout)
    assert out["response"]["status_code"] == 200 and _Busy.posts == 3
    assert out["response"]["request_id"] == "cmpl-1"
