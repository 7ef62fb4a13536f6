"""``tools`` and ``tool_choice`` on ``/v1/chat/completions``.

- ``none``: the model answers in text (the tools are not shown to it).
- ``required`` and a named function: the output is sampled under a grammar (llguidance), so
  the arguments always parse against the function's ``parameters`` schema. ``required``
  writes a JSON list of ``{"name", "parameters"}`` (one or more calls; one when
  ``parallel_tool_calls`` is false); a named function writes its arguments object.
- ``auto`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as in vLLM): the
  model writes what it likes; the parser finds its tool calls in the text.

The chat template sees ``tools``. Answers carry ``message.tool_calls`` with finish reason
``tool_calls``; streams carry OpenAI tool-call deltas (id, type and name, then the
arguments). A named function's arguments stream as they are generated; ``required`` and
``auto`` calls go out when complete (content before an ``auto`` call streams as usual).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.sampling_params import GrammarSpec
from pdserve.server.protocol import bad_request, get_bool
from pdserve.structured.tool_parsers import PARSERS, ToolCall, parse_required

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags for tool calling."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]]
    choice: str  # none, auto, required or named
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # auto: the server's --tool-call-parser

    @classmethod
    def read(cls, body: dict, settings: ToolSettings) -> ToolRequest | None:
        tools = _read_tools(body.get("tools"))
        choice, name = _read_choice(body.get("tool_choice"), tools)
        parallel = get_bool(body, "parallel_tool_calls", True)
        if not tools or choice == "none":
            return None
        if choice == "auto" and not (settings.enable_auto_tool_choice
                                     and settings.tool_call_parser):
            raise bad_request('"auto" tool choice needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser",
                              param="tool_choice")
        return cls(tools, choice, name, parallel, settings.tool_call_parser)

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return self.tools

    def grammar(self) -> GrammarSpec | None:
        """The grammar of ``required`` and named choices; None for ``auto``."""
        if self.choice == "named":
            schema = self._parameters()[self.name]
            return GrammarSpec("json", json.dumps(schema), "tools")
        if self.choice == "required":
            return GrammarSpec("json", json.dumps(self._required_schema()), "tools")
        return None

    def _parameters(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT
                for t in self.tools}

    def _required_schema(self) -> dict[str, Any]:
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in self._parameters().items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished output as (content, tool calls)."""
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            calls = parse_required(text)
            return (text, []) if calls is None else (None, calls)
        return PARSERS[self.parser]().extract(text)

    def finish_choice(self, choice: dict[str, Any]) -> None:
        """Rewrites a whole chat choice: its text becomes content and tool calls."""
        message = choice["message"]
        content, calls = self.split(message.get("content") or "")
        message["content"] = content
        if calls:
            message["tool_calls"] = [_call_body(call) for call in calls]
            choice["finish_reason"] = _finish(choice["finish_reason"])


def _finish(reason: str | None) -> str | None:
    # A call cut short by max_tokens keeps "length": its arguments may not parse.
    return "tool_calls" if reason == "stop" else reason


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _read_tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of function tools", param="tools")
    return [_read_tool(tool, i) for i, tool in enumerate(value)]


def _read_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(function, dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}",
                          param="tools")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise bad_request(f"{where}.function.name must be a non-empty string", param="tools")
    if not isinstance(function.get("parameters", {}), (dict, type(None))):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          param="tools")
    return tool


def _read_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None  # OpenAI's default
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request("tool_choice 'required' needs 'tools'", param="tool_choice")
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) \
        and value.get("type") == "function" and isinstance(value.get("function"), dict) \
        else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names function '{name}', which is not in 'tools'",
                          param="tool_choice")
    return "named", name


@dataclass
class ToolStream:
    """One streamed choice's text turned into content and tool-call deltas."""

    request: ToolRequest
    text: str = ""  # everything generated so far
    sent: int = 0  # characters of it already sent (as content or named arguments)
    calls: int = 0  # tool calls begun

    def push(self, text: str, finish_reason: str | None
             ) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas for new ``text`` (content, then each call's header and arguments) and
        the finish reason to send."""
        self.text += text
        if self.request.choice == "named":
            return self._named(), _finish(finish_reason)
        if finish_reason:
            content, calls = self.request.split(self.text[self.sent:])
            if calls:
                self.sent = len(self.text)
                deltas = [{"content": content}] if content else []
                return deltas + [d for c in calls for d in self._call(c) if d], \
                    _finish(finish_reason)
        end = len(self.text) if finish_reason else self._content_end()
        content, self.sent = self.text[self.sent:end], max(self.sent, end)
        return ([{"content": content}] if content else []), finish_reason

    def _content_end(self) -> int:
        if self.request.choice == "required":
            return self.sent  # all of it is the calls' JSON: sent when complete
        return PARSERS[self.request.parser]().content_end(self.text)

    def _named(self) -> list[dict[str, Any]]:
        piece, self.sent = self.text[self.sent:], len(self.text)
        deltas = self._call(ToolCall(self.request.name, piece)) if self.calls == 0 else \
            [_arguments(0, piece)]
        return [d for d in deltas if d is not None]

    def _call(self, call: ToolCall) -> list[dict[str, Any] | None]:
        index, self.calls = self.calls, self.calls + 1
        header = {"index": index, "id": new_call_id(), "type": "function",
                  "function": {"name": call.name, "arguments": ""}}
        return [{"tool_calls": [header]}, _arguments(index, call.arguments)]


def _arguments(index: int, piece: str) -> dict[str, Any] | None:
    if not piece:
        return None
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
