"""``pdserve chat`` and ``pdserve complete``: talk to a running server (or a P/D gateway, or
any OpenAI-compatible server) from a terminal, as ``vllm chat`` and ``vllm complete`` do.

Each line read is one request, its answer streamed as it comes. ``chat`` keeps the
conversation (an optional system prompt, then every exchange that was answered); a request
the server refuses is reported and left out of it, so one bad line ends nothing.
``--quick TEXT`` sends one request and exits (status 1 if the server refused it).

The standard library's HTTP client is enough for one request at a time, and keeps these
commands free of the server's and the benchmark's dependencies.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TextIO

DEFAULT_URL = "http://localhost:8000/v1"
API_KEY_ENVS = ("PDSERVE_API_KEY", "OPENAI_API_KEY")


class ServerError(Exception):
    """The server answered with an error (its OpenAI-style message), or could not be
    reached."""


class ServerClient:
    """The few calls the terminal clients make, against ``url`` (the API's base, ``/v1``)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def first_model(self) -> str:
        """The first name ``GET /models`` lists: the served model, as vLLM's clients pick."""
        with self._open("GET", "/models") as resp:
            models = json.load(resp).get("data") or []
        if not models:
            raise ServerError(f"{self.url}/models lists no model; name one with --model-name")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """The answer's text, piece by piece, from a streamed ``POST path``."""
        with self._open("POST", path, {**body, "stream": True}) as resp:
            for line in self._lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise ServerError(f"{self.url} streamed a line that is not JSON: "
                                      f"{data[:80]!r}") from None
                yield _text_of(chunk)
        raise ServerError(f"the answer from {self.url} broke off before its end")

    def _lines(self, resp) -> Iterator[str]:
        """The stream's lines; a connection that breaks or stalls mid-answer is a
        ``ServerError`` (the terminal session goes on), not a crash."""
        try:
            for raw in resp:
                yield raw.decode("utf-8").strip()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"the answer from {self.url} broke off: "
                              f"{type(exc).__name__} {exc}".rstrip()) from None

    def _open(self, method: str, path: str, body: dict[str, Any] | None = None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            hint = ""
            if exc.code == 404 and not self.url.endswith("/v1"):
                hint = f" (--url is the API's base: did you mean {self.url}/v1?)"
            raise ServerError(f"{exc.code}: {_error_message(exc.read())}{hint}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"cannot reach {self.url}: {reason}") from None


def _text_of(chunk: dict[str, Any]) -> str:
    """One streamed chunk's text: a chat delta's content or a completion's text; an error
    sent inside the stream (after the answer began) raises."""
    if "error" in chunk:
        raise ServerError(_message_of(chunk["error"]))
    choices = chunk.get("choices") or []
    if not choices:
        return ""  # the usage chunk
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _error_message(raw: bytes) -> str:
    """An error answer's message: OpenAI's ``{"error": {"message"}}``, else its text."""
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace").strip() or "no message"
    return _message_of(error)


def _message_of(error: Any) -> str:
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


def add_parsers(sub) -> tuple[str, ...]:
    """Adds ``chat`` and ``complete``; returns their names (their ``-q`` is ``--quick``)."""
    chat = sub.add_parser(
        "chat", help="Chat with a running server from the terminal.",
        description="Send each line read as a user message to a running server's "
        "/v1/chat/completions, the conversation kept, the answer streamed (as vllm chat). "
        "End with Ctrl-D.")
    chat.add_argument("--system-prompt", default=None,
                      help="A system message to open the conversation with.")
    complete = sub.add_parser(
        "complete", help="Complete prompts with a running server from the terminal.",
        description="Send each line read as a prompt to a running server's /v1/completions, "
        "the completion streamed (as vllm complete). End with Ctrl-D.")
    for parser, func in ((chat, run_chat), (complete, run_complete)):
        parser.add_argument("--url", default=DEFAULT_URL,
                            help=f"The server's API base (default: {DEFAULT_URL}).")
        parser.add_argument("--model-name", default=None,
                            help="The model to ask (default: the first the server lists).")
        parser.add_argument("--api-key", default=None,
                            help="Bearer token (default: $PDSERVE_API_KEY, then "
                            "$OPENAI_API_KEY).")
        parser.add_argument("--max-tokens", type=int, default=None,
                            help="The answer's token limit (default: the server's).")
        parser.add_argument("--temperature", type=float, default=None,
                            help="Sampling temperature (default: the server's).")
        parser.add_argument("--timeout-s", type=float, default=600.0,
                            help="Seconds to wait for the server before giving up on a "
                            "request (default: 600).")
        parser.add_argument("-q", "--quick", default=None, metavar="TEXT",
                            help="Send TEXT once, print the answer and exit.")
        parser.set_defaults(func=func)
    return ("chat", "complete")


Answer = Callable[[str], bool]
"""Sends one line, prints its answer; False if the server refused it."""


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    def chat(client: ServerClient, body: dict[str, Any], stdout: TextIO) -> Answer:
        messages = [] if args.system_prompt is None else [
            {"role": "system", "content": args.system_prompt}]

        def answer(line: str) -> bool:
            messages.append({"role": "user", "content": line})
            text = _print_stream(
                client.stream("/chat/completions", {**body, "messages": messages}), stdout)
            if text is None:
                messages.pop()  # refused: the conversation goes on without it
                return False
            messages.append({"role": "assistant", "content": text})
            return True

        return answer

    return _run(args, chat, stdin, stdout)


def run_complete(args: argparse.Namespace, stdin: TextIO | None = None,
                 stdout: TextIO | None = None) -> int:
    def complete(client: ServerClient, body: dict[str, Any], stdout: TextIO) -> Answer:
        def answer(line: str) -> bool:
            stream = client.stream("/completions", {**body, "prompt": line})
            return _print_stream(stream, stdout) is not None

        return answer

    return _run(args, complete, stdin, stdout)


def _run(args: argparse.Namespace,
         answerer: Callable[[ServerClient, dict[str, Any], TextIO], Answer],
         stdin: TextIO | None, stdout: TextIO | None) -> int:
    started = _start(args)
    if started is None:
        return 1
    stdout = stdout or sys.stdout
    return _loop(args, answerer(*started, stdout), stdin or sys.stdin, stdout)


def _start(args: argparse.Namespace) -> tuple[ServerClient, dict[str, Any]] | None:
    """The client and the fields every request carries; None, the reason printed, when the
    server cannot name its model."""
    api_key = args.api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)),
                                   None)
    client = ServerClient(args.url, api_key, args.timeout_s)
    try:
        model = args.model_name or client.first_model()
    except ServerError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return None
    body: dict[str, Any] = {"model": model}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return client, body


def _loop(args: argparse.Namespace, answer: Answer, stdin: TextIO, stdout: TextIO
          ) -> int:
    """``--quick``: one answer, status 1 if refused; otherwise every line read until EOF."""
    if args.quick is not None:
        return 0 if answer(args.quick) else 1
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            return 0
        if line.strip():
            answer(line.rstrip("\n"))


def _print_stream(pieces: Iterator[str], stdout: TextIO) -> str | None:
    """Writes the pieces as they come and returns the whole text; None after printing the
    server's error instead (what was streamed before it stays on the screen)."""
    text = []
    try:
        for piece in pieces:
            stdout.write(piece)
            stdout.flush()
            text.append(piece)
    except ServerError as exc:
        stdout.write(("\n" if text else "") + f"error: {exc}\n")
        return None
    stdout.write("\n")
    return "".join(text)
