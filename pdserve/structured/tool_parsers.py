"""Tool calls read from a model's text: the Llama 3.x JSON form and the Hermes
``<tool_call>`` form (Qwen2.5), picked by ``--tool-call-parser`` as in vLLM.

Each parser splits a finished output into content and tool calls, and tells a stream how
much of the text so far is surely content (the rest might still become a tool call).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them,
    after optional content."""

    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the text stays content
            calls.append(call)
        return text[:start].strip() or None, calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _prefix_overlap(text, self.START)


class Llama3JsonParser:
    """Llama 3.x: the whole output is one JSON object ``{"name": ..., "parameters": {...}}``
    (or several separated by ``;``), optionally after ``<|python_tag|>``."""

    TAG = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, pos = self._decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            pos = len(body) - len(body[pos:].lstrip().lstrip(";").lstrip())
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.TAG) \
                or self.TAG.startswith(body):
            return 0  # a tool call, or text that may yet become one: nothing is content yet
        return len(text)


PARSERS = {"llama3_json": Llama3JsonParser, "hermes": HermesParser}


def parse_required(text: str) -> list[ToolCall] | None:
    """The output of ``tool_choice: required``: a JSON list of ``{"name", "parameters"}``;
    None when it is not one (cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    calls = [_call(item, ("parameters",)) for item in items] if isinstance(items, list) else []
    return calls if calls and all(calls) else None
