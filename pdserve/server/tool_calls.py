"""``tools`` and ``tool_choice`` on ``/v1/chat/completions``.

- ``none``: the model answers in text (the tools are not shown to it).
- ``required`` and a named function: the output is sampled under a grammar (llguidance), so
  the arguments always parse against the function's ``parameters`` schema. ``required``
  writes a JSON list of ``{"name", "parameters"}`` (one or more calls; one when
  ``parallel_tool_calls`` is false); a named function writes its arguments object.
- ``auto`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as in vLLM): the
  model writes what it likes; the parser finds its tool calls in the text.

The chat template sees ``tools``. Answers carry ``message.tool_calls`` with finish reason
``tool_calls``; streams carry OpenAI tool-call deltas: a call's index, id, type and name as
soon as its name is read, then its arguments as they are generated (content before an
``auto`` call streams as content). The stream and the whole answer read the text with the
same reader (``pdserve.structured.tool_parsers``), so the argument pieces add up to the
whole answer's arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.sampling_params import GrammarSpec
from pdserve.server.protocol import bad_request, get_bool
from pdserve.structured.tool_parsers import (
    READERS,
    Arguments,
    CallStart,
    Content,
    Event,
    RequiredReader,
    ToolCall,
    ToolCallReader,
    read_whole,
)

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

    def reader(self) -> ToolCallReader:
        """A reader of the output's calls (``required`` and ``auto``)."""
        return RequiredReader() if self.choice == "required" else READERS[self.parser]()

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished output as (content, tool calls)."""
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        content, calls = read_whole(self.reader(), text)
        return content, calls if self.parallel else calls[:1]

    def kept(self, events: list[Event]) -> list[Event]:
        """The events of the calls the answer keeps: the first only, without parallel calls
        (``auto``; the grammar of ``required`` already allows one)."""
        if self.parallel:
            return events
        return [e for e in events if isinstance(e, Content) or e.index == 0]

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


def template_tools(body: dict) -> list[dict[str, Any]] | None:
    """The tools a chat template sees for this request (what ``/tokenize`` shows of a
    chat's prompt): its tools, unless its ``tool_choice`` is ``none``."""
    tools = _read_tools(body.get("tools"))
    choice, _ = _read_choice(body.get("tool_choice"), tools)
    return tools if tools and choice != "none" else None


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
    """One streamed choice's text turned into content and tool-call deltas as it comes."""

    request: ToolRequest
    reader: ToolCallReader | None = None  # required and auto; a named call is all arguments
    named_started: bool = False

    def __post_init__(self) -> None:
        if self.request.choice != "named":
            self.reader = self.request.reader()

    def push(self, text: str, finish_reason: str | None
             ) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas for new ``text`` (content, each call's header, pieces of its
        arguments) and the finish reason to send."""
        if self.reader is None:
            return self._named(text), _finish(finish_reason)
        events = self.reader.push(text)
        if finish_reason:
            events += self.reader.finish()
        finish = finish_reason
        if finish == "stop" and self.reader.well_formed:
            finish = "tool_calls"
        return _deltas(self.request.kept(events)), finish

    def _named(self, text: str) -> list[dict[str, Any]]:
        events: list[Event] = [Arguments(0, text)] if text else []
        if not self.named_started:
            self.named_started = True
            events.insert(0, CallStart(0, self.request.name))
        return _deltas(events)


def _deltas(events: list[Event]) -> list[dict[str, Any]]:
    """One delta per call header; consecutive content, or pieces of one call's arguments,
    merged into one."""
    deltas: list[dict[str, Any]] = []
    last: Event | None = None
    for event in events:
        if isinstance(event, CallStart):
            deltas.append({"tool_calls": [_header(event)]})
        elif isinstance(event, Content) and isinstance(last, Content):
            deltas[-1]["content"] += event.text
        elif isinstance(event, Content):
            deltas.append({"content": event.text})
        elif isinstance(last, Arguments) and last.index == event.index:
            deltas[-1]["tool_calls"][0]["function"]["arguments"] += event.text
        else:
            deltas.append({"tool_calls": [{"index": event.index,
                                           "function": {"arguments": event.text}}]})
        last = event
    return deltas


def _header(start: CallStart) -> dict[str, Any]:
    return {"index": start.index, "id": new_call_id(), "type": "function",
            "function": {"name": start.name, "arguments": ""}}
