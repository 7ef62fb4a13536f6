"""OpenAI's Responses API, read and written: a ``/v1/responses`` request as the chat request
it runs as, the answer as output items and stream events, and the stored responses.

A response runs as a chat completion (``responses_routes.py``): its ``instructions`` and
``input`` (a string, or messages, function calls and their outputs) become the chat's
messages, ``text.format`` its ``response_format``, its function tools and ``tool_choice``
the chat's; the answer's thought (``--reasoning-parser``), text and tool calls become
``reasoning``, ``message`` and ``function_call`` items. So what a chat honours - grammars,
tool calling, the generation config's defaults, vLLM's sampling fields - behaves the same
here; what it refuses is refused here, under the Responses API's field names.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.server import protocol as P
from pdserve.server.reasoning import ThinkSplitter
from pdserve.server.responses_store import ResponseStore, not_found
from pdserve.server.tool_calls import ToolStream

ENDPOINT = "/v1/responses"
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_VALUE_CHARS = 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# vLLM's sampling extensions, passed to the chat as they are.
CHAT_SAMPLING_FIELDS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                        "min_tokens", "presence_penalty", "frequency_penalty",
                        "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
                        "skip_special_tokens", "include_stop_str_in_output", "priority",
                        "chat_template", "chat_template_kwargs")

RESPONSES_FIELDS: dict[str, P.FieldRule] = {
    **dict.fromkeys(("model", "input", "instructions", "max_output_tokens", "temperature",
                     "top_p", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                     "text", "stream", "store", "previous_response_id", "metadata", "user",
                     "safety_identifier", "include", "reasoning", "background",
                     *CHAT_SAMPLING_FIELDS),
                    P.HONOURED),
    "truncation": P.Refused("an input longer than the context is refused, never cut",
                            ("disabled",)),
    "service_tier": P.Refused("there is one service tier", ("auto", "default")),
    "max_tool_calls": P.Refused("tool calls are not counted across turns"),
    "prompt": P.Refused("stored prompt templates are not implemented"),
    "conversation": P.Refused("conversations are not stored; use 'previous_response_id'"),
    "prompt_cache_key": P.Refused("the prefix cache is shared and automatic: there are no "
                                  "cache keys"),
    "stream_options": P.Refused("the Responses stream has no options here", ({},)),
}
"""``/v1/responses``: every field it takes; any other is refused with 400."""

# A chat field named in an error, as the Responses API calls it.
_CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                      "max_tokens": "max_output_tokens", "response_format": "text.format",
                      "logprobs": "top_logprobs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request ----------------------------------------------------------------------------


@dataclass
class ResponsesRequest:
    body: dict[str, Any]
    chat: dict[str, Any]
    """The chat request it runs as."""
    conversation: list[dict[str, Any]]
    """The messages before the answer, instructions left out: what a stored response
    continues from."""
    store: bool
    stream: bool
    metadata: dict[str, str] | None = None
    logprobs: bool = False
    background: bool = False
    """Answered at once (``queued``), run apart from the request, fetched with ``GET``."""

    @classmethod
    def read(cls, body: dict, store: ResponseStore) -> ResponsesRequest:
        """Raises ``APIError``: 400 for what is malformed or refused, 404 for a
        ``previous_response_id`` not stored."""
        P.check_fields(body, RESPONSES_FIELDS, ENDPOINT)
        stored = _wants_store(body, store)
        conversation = _previous(body, store) + input_messages(body.get("input"))
        instructions = P.get_str(body, "instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        logprobs = _read_include(body) or bool(P.get_int(body, "top_logprobs"))
        chat = {"messages": system + conversation, "stream": False,
                **{name: body[name] for name in CHAT_SAMPLING_FIELDS if name in body},
                **_sampling(body, logprobs), **_tools(body), **_text_format(body)}
        _read_reasoning(body)
        return cls(body, chat, conversation, stored, P.get_bool(body, "stream"),
                   _read_metadata(body), logprobs, _read_background(body, stored))

    def conversation_after(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The conversation a continuation of ``response`` starts from."""
        return self.conversation + output_messages(response)


def _wants_store(body: dict, store: ResponseStore) -> bool:
    """OpenAI stores a response unless told not to; a server that keeps none refuses an
    explicit ``store: true``."""
    wanted = P.get_bool(body, "store", True)
    if wanted and store.capacity == 0 and body.get("store") is not None:
        raise P.bad_request("'store' is not supported: this server keeps no responses "
                            "(--max-stored-responses 0, or several HTTP processes)",
                            param="store")
    return wanted and store.capacity > 0


def _read_background(body: dict, stored: bool) -> bool:
    background = P.get_bool(body, "background")
    if background and not stored:
        raise P.bad_request("'background' needs a stored response (it is fetched with GET): "
                            "send 'store': true to a server that keeps responses",
                            param="background")
    if background and P.get_bool(body, "stream"):
        raise P.bad_request("a background response is fetched with GET, not streamed: send "
                            "'stream': false", param="background")
    return background


def _previous(body: dict, store: ResponseStore) -> list[dict[str, Any]]:
    previous = P.get_str(body, "previous_response_id")
    if previous is None:
        return []
    stored = store.get(previous)
    if stored is None:
        raise not_found(previous)
    return copy.deepcopy(stored.conversation)


def _sampling(body: dict, logprobs: bool) -> dict[str, Any]:
    chat = {name: body[name] for name in ("model", "temperature", "top_p") if name in body}
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if not P.is_int(max_output) or max_output < 1:
            raise P.bad_request("'max_output_tokens' must be an integer >= 1",
                                param="max_output_tokens")
        chat["max_completion_tokens"] = max_output
    top = P.get_int(body, "top_logprobs")
    if logprobs:
        chat["logprobs"] = True
    if top:
        chat["top_logprobs"] = top
    user = P.get_str(body, "user") or P.get_str(body, "safety_identifier")
    if user is not None:
        chat["user"] = user
    return chat


def _read_include(body: dict) -> bool:
    """Whether ``include`` asks for the output text's logprobs (the one thing it may)."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise P.bad_request("'include' must be a list of strings", param="include")
    for name in include:
        if name != LOGPROBS_INCLUDE:
            raise P.bad_request(f"'include' may name only '{LOGPROBS_INCLUDE}', not '{name}'",
                                param="include")
    return bool(include)


def _read_reasoning(body: dict) -> None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise P.bad_request("'reasoning' must be an object", param="reasoning")
    for name, value in reasoning.items():
        if value is not None:
            raise P.bad_request(f"'reasoning.{name}' is not supported: the model's thinking is "
                                "neither steered nor summarised here (with "
                                "--reasoning-parser it comes back as a reasoning item)",
                                param=f"reasoning.{name}")


def _read_metadata(body: dict) -> dict[str, str] | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS
            for k, v in metadata.items()):
        raise P.bad_request(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} "
                            f"string values of at most {MAX_METADATA_VALUE_CHARS} characters",
                            param="metadata")
    return metadata


def _tools(body: dict) -> dict[str, Any]:
    """Function tools and ``tool_choice`` in the chat's form."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise P.bad_request("'tools' must be a list of function tools", param="tools")
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise P.bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    return chat


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise P.bad_request(f"{where}: only function tools are supported"
                            + (f", not '{kind}'" if kind else ""), param="tools")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise P.bad_request(f"{where}: unknown field '{sorted(unknown)[0]}'", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _text_format(body: dict) -> dict[str, Any]:
    """``text.format`` as the chat's ``response_format``."""
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise P.bad_request("'text' must be an object with 'format'", param="text")
    if text.get("verbosity") is not None:
        raise P.bad_request("'text.verbosity' is not supported: the model is not steered",
                            param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise P.bad_request("'text.format.type' must be 'text', 'json_object' or 'json_schema'",
                        param="text.format")


def responses_error(exc: P.APIError) -> P.APIError:
    """A chat's error under the Responses API's field names."""
    param = exc.param or ""
    name = param.split("[", 1)[0]
    if name not in _CHAT_TO_RESPONSES:
        return exc
    message = exc.message.replace(f"'{name}'", f"'{_CHAT_TO_RESPONSES[name]}'")
    if name == "messages":
        message = message.replace("messages[", "the conversation's message [")
    return P.APIError(exc.status, message, _CHAT_TO_RESPONSES[name], exc.code, exc.headers)


# ---- the input as chat messages ---------------------------------------------------------------


_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text",
               "refusal": "refusal"}


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is the user's message; items are messages,
    function calls (merged into the assistant message before them) and their outputs.
    Reasoning items are left out, as reasoning models' chat templates leave out the
    thoughts of earlier turns."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise P.bad_request("'input' must be a string or a non-empty list of items",
                            param="input")
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    for i, item in enumerate(value):
        _add_item(messages, item, f"input[{i}]", names)
    return messages


def _add_item(messages: list[dict], item: Any, where: str, names: dict[str, str]) -> None:
    if not isinstance(item, dict):
        raise P.bad_request(f"{where} must be an object", param="input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        messages.append({"role": _role(item, where), "content": _text(item.get("content"),
                                                                      where)})
    elif kind == "function_call":
        call = {"id": _str(item, "call_id", where), "type": "function",
                "function": {"name": _str(item, "name", where),
                             "arguments": _str(item, "arguments", where)}}
        names[call["id"]] = call["function"]["name"]
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        call_id = _str(item, "call_id", where)
        message = {"role": "tool", "tool_call_id": call_id,
                   "content": _text(item.get("output"), where)}
        if call_id in names:
            message["name"] = names[call_id]
        messages.append(message)
    elif kind != "reasoning":
        raise P.bad_request(f"{where}: input items of type '{kind}' are not supported (messages, "
                            "function_call, function_call_output and reasoning are)",
                            param="input")


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise P.bad_request(f"{where}.role must be user, system, developer or assistant",
                            param="input")
    return role


def _str(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise P.bad_request(f"{where}.{name} must be a string", param="input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad_request(f"{where}.content must be a string or a list of parts",
                            param="input")
    texts = []
    for part in content:
        key = _TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if key is None or not isinstance(part.get(key), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise P.bad_request(f"{where}: only text parts are supported"
                                + (f", not '{kind}'" if kind else ""), param="input")
        texts.append(part[key])
    return "".join(texts)


# ---- the answer --------------------------------------------------------------------------------


def skeleton(request: ResponsesRequest, response_id: str, created: int, model: str,
             temperature: float, top_p: float) -> dict[str, Any]:
    """The response object before any output, echoing how it was asked for."""
    body = request.body
    return {
        "id": response_id, "object": "response", "created_at": created, "status": "in_progress",
        "background": request.background, "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens":
        body.get("max_output_tokens"), "metadata": request.metadata or {}, "model": model,
        "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": request.store,
        "temperature": temperature, "top_p": top_p,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [], "top_logprobs": body.get("top_logprobs"),
        "truncation": "disabled", "user": body.get("user"), "usage": None,
    }


@dataclass
class ResponseBuilder:
    """One answer's pieces as output items and the stream's events (whole answers take the
    same path and drop the events)."""

    response: dict[str, Any]
    thinking: ThinkSplitter | None = None
    tools: ToolStream | None = None
    logprobs: bool = False
    _open: dict[str, Any] | None = None  # the item being written
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by the call's index
    _sequence: itertools.count = field(default_factory=itertools.count)

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def push(self, piece: P.Piece) -> list[dict[str, Any]]:
        """The events of an engine piece: its text split into thought, text and tool calls
        as the chat would split it."""
        final = piece.finish_reason is not None
        text, reasoning = piece.text, ""
        if self.thinking is not None:
            reasoning, text = self.thinking.push(text, final, len(piece.token_ids))
        deltas = self._deltas(text, piece.finish_reason)
        if reasoning:
            deltas.insert(0, {"reasoning": reasoning})
        logprobs = P.chat_logprobs(piece)["content"] if self.logprobs else []
        return self.push_deltas(deltas, logprobs)

    def push_deltas(self, deltas: list[dict[str, Any]], logprobs: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
        """The events of chat deltas (``reasoning``, ``content``, ``tool_calls``) and the
        logprobs of their tokens (the chat's ``logprobs.content``), which go with the text."""
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._text(delta["content"], logprobs)
                logprobs = []
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        if logprobs and self._kind() == "message":
            events += self._text("", logprobs)  # tokens whose text is held back
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None
               ) -> list[dict[str, Any]]:
        """The last events; ``self.response`` is then the whole response (its usage null
        where the answer came without one)."""
        complete = finish_reason != "length"
        events = self._close("completed" if complete else "incomplete")
        if not self.response["output"]:
            events += self._text("", []) + self._close("completed")
        self.response["status"] = "completed" if complete else "incomplete"
        if not complete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = self._usage(usage) if usage is not None else None
        kind = "response.completed" if complete else "response.incomplete"
        return events + [self._event(kind, response=self._snapshot())]

    def cancel(self) -> None:
        """A background response stopped by its client: what it wrote so far stays."""
        self._close("incomplete")
        self.response["status"] = "cancelled"

    def fail(self, message: str) -> list[dict[str, Any]]:
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        return [self._event("response.failed", response=self._snapshot())]

    def _deltas(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        if self.tools is not None:
            return self.tools.push(text, finish_reason)[0]
        return [{"content": text}] if text else []

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = self._begin("reasoning") if self._kind() != "reasoning" else []
        item = self._open
        item["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", item_id=item["id"],
                                     output_index=self._index(), content_index=0, delta=text)]

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = self._begin("message") if self._kind() != "message" else []
        item = self._open
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", item_id=item["id"],
                                     output_index=self._index(), content_index=0, delta=text,
                                     logprobs=[_delta_logprob(lp) for lp in logprobs])]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if "id" in call:  # a call's header: a new item
            events += self._begin("function_call", call_id=call["id"],
                                  name=call["function"]["name"])
            self._calls[call["index"]] = self._open
        item = self._calls[call["index"]]
        piece = call["function"].get("arguments", "")
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self._index(item),
                                      delta=piece))
        return events

    def _begin(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        events = self._close("completed")
        item = _new_item(kind, **fields)
        self.response["output"].append(item)
        self._open = item
        events.append(self._event("response.output_item.added", output_index=self._index(),
                                  item=_added(item)))
        if kind in ("message", "reasoning"):
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._index(), content_index=0,
                                      part=_empty_part(item["content"][0])))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index(item)}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done",
                                  arguments=item["arguments"], **where)]
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            extra = {"logprobs": [_delta_logprob(lp) for lp in part["logprobs"]]} \
                if item["type"] == "message" else {}
            events = [self._event(done, content_index=0, text=part["text"], **extra, **where),
                      self._event("response.content_part.done", content_index=0,
                                  part=copy.deepcopy(part), **where)]
        return events + [self._event("response.output_item.done", output_index=where[
            "output_index"], item=copy.deepcopy(item))]

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _index(self, item: dict[str, Any] | None = None) -> int:
        item = self._open if item is None else item
        return next(i for i, it in enumerate(self.response["output"]) if it is item)

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(usage)},
                "total_tokens": usage["total_tokens"]}

    def _reasoning_tokens(self, usage: dict[str, Any]) -> int:
        """The thought's tokens: as the chat counted them (through a gateway), else as
        this answer's own reader did."""
        counted = P.reasoning_tokens(usage)
        if counted is not None:
            return counted
        return self.thinking.thought_tokens if self.thinking is not None else 0

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}


def _new_item(kind: str, **fields: Any) -> dict[str, Any]:
    if kind == "message":
        return {"type": "message", "id": new_id("msg"), "status": "in_progress",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": [],
                             "logprobs": []}]}
    if kind == "reasoning":
        return {"type": "reasoning", "id": new_id("rs"), "status": "in_progress", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}]}
    return {"type": "function_call", "id": new_id("fc"), "status": "in_progress",
            "arguments": "", **fields}


def _added(item: dict[str, Any]) -> dict[str, Any]:
    """An item as ``output_item.added`` shows it: nothing written yet."""
    return {**item, "content": []} if "content" in item else dict(item)


def _empty_part(part: dict[str, Any]) -> dict[str, Any]:
    return {**part, "text": "", **({"logprobs": []} if "logprobs" in part else {})}


def _delta_logprob(logprob: dict[str, Any]) -> dict[str, Any]:
    """A token's logprob as the stream's text events carry it (no bytes)."""
    return {"token": logprob["token"], "logprob": logprob["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in logprob["top_logprobs"]]}


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a continuation sees: its text and tool
    calls as one assistant message (its thought left out)."""
    text, calls = "", []
    for item in response["output"]:
        if item["type"] == "message":
            text += item["content"][0]["text"]
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
