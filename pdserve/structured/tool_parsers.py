"""Tool calls read from a model's text as it is generated: the ``tool_choice: required``
list, the Llama 3.x JSON form and the Hermes ``<tool_call>`` form (Qwen2.5), the last two
picked by ``--tool-call-parser`` as in vLLM.

A reader takes the text piece by piece and returns events: content, a call's start (its
name) and pieces of its arguments, each as soon as it is sure. A call's arguments are the
exact JSON text the model wrote (a string value is decoded: some models write the arguments
as JSON text), so the pieces a stream sends add up to what the whole answer carries: the
whole answer is the same reader fed everything at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


class _ValueScanner:
    """Finds where one JSON value ends, a character at a time (strings, escapes, nesting);
    it does not validate: a finished call's text is checked with ``json.loads``."""

    __slots__ = ("depth", "in_string", "escape", "scalar", "size", "done")

    def __init__(self) -> None:
        self.depth = self.size = 0
        self.in_string = self.escape = self.scalar = self.done = False

    def take(self, ch: str) -> bool:
        """Whether ``ch`` belongs to the value (False: the value ended just before it)."""
        if self.scalar:
            if ch in ",}]" or ch in WHITESPACE:
                self.done = True
                return False
            return True
        self.size += 1
        if self.in_string:
            self._take_in_string(ch)
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth <= 0
        elif self.size == 1:
            self.scalar = True  # a number, true, false or null
        return True

    def _take_in_string(self, ch: str) -> None:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            self.done = self.depth == 0


class CallReader:
    """One call object ``{"name": "f", "<arguments key>": {...}}`` read as it arrives.

    Its arguments go out (``take_arguments``) only once its name is known; keys other than
    the name and the first arguments key are skipped.
    """

    _EXPECTED = {"open": "{", "first_key": '"}', "key": '"', "colon": ":", "next": ",}"}

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self.arguments_keys = arguments_keys
        self.state = "open"
        self.name: str | None = None
        self.raw = ""  # the object's text so far
        self.failed = False
        self.done = False
        self._key: object = None
        self._role = ""  # what the value being read is: key, name, arguments or skip
        self._value: _ValueScanner | None = None
        self._value_text = ""
        self._has_arguments = False
        self._arguments_out = ""  # not yet taken

    def feed(self, text: str, pos: int, end: int) -> int:
        """Reads ``text[pos:end]`` until the object closes or fails; returns where it
        stopped."""
        while pos < end and not (self.done or self.failed):
            ch = text[pos]
            if self._value is not None and not self._value.take(ch):
                self._end_value()  # a number ended: ``ch`` belongs to the object
                continue
            pos += 1
            self.raw += ch
            if self._value is not None:
                self._add_value_char(ch)
            elif ch not in WHITESPACE:
                self._structural(ch)
        return pos

    def _structural(self, ch: str) -> None:
        if self.state == "value":
            self._start_value(self._value_role(), ch)
        elif ch not in self._EXPECTED[self.state]:
            self.failed = True
        elif ch == "}":
            self._close()
        elif ch == '"':
            self._start_value("key", ch)
        else:
            self.state = {"{": "first_key", ",": "key", ":": "value"}[ch]

    def _value_role(self) -> str:
        if self._key == "name" and self.name is None:
            return "name"
        if self._key in self.arguments_keys and not self._has_arguments:
            self._has_arguments = True
            return "arguments"
        return "skip"

    def _start_value(self, role: str, ch: str) -> None:
        self._role, self._value, self._value_text = role, _ValueScanner(), ""
        self._value.take(ch)
        self._add_value_char(ch)

    def _add_value_char(self, ch: str) -> None:
        self._value_text += ch
        if self._role == "arguments" and self._value_text[0] != '"':
            self._arguments_out += ch
        if self._value.done:
            self._end_value()

    def _end_value(self) -> None:
        role, text, self._value = self._role, self._value_text, None
        value = _loads(text)
        if role == "key":
            self._key, self.state = value, "colon"
            return
        self.state = "next"
        if role == "name":
            self.name = value if isinstance(value, str) else None
            self.failed = self.name is None
        elif role == "arguments" and text[0] == '"':
            self._arguments_out += value if isinstance(value, str) else ""

    def _close(self) -> None:
        if not self._has_arguments:
            self._arguments_out += "{}"
        self.done = True
        self.failed = self.name is None or _loads(self.raw) is _INVALID

    def take_arguments(self) -> str:
        """The arguments' text read since the last call (nothing before the name is known)."""
        if self.name is None:
            return ""
        out, self._arguments_out = self._arguments_out, ""
        return out


_INVALID = object()


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


@dataclass
class ToolCallReader:
    """A whole output's text, piece by piece, into events. Subclasses are the formats: each
    ``_<state>`` method reads from ``pos`` and returns whether it made progress.

    A call that turns out malformed (or an output that cannot be calls) makes the rest
    content: all of the text when no call was announced yet, so a whole answer that is not
    well-formed calls is plain content; the text from the fault on otherwise (the stream
    already sent the call's start).
    """

    arguments_keys: tuple[str, ...] = ("parameters", "arguments")
    text: str = ""
    pos: int = 0  # next character to read
    emitted: int = 0  # end of the text sent as content
    state: str = "lead"
    calls: int = 0  # calls announced (their CallStart sent)
    failed: bool = False
    call: CallReader | None = None
    events: list[Event] = field(default_factory=list)

    def push(self, text: str) -> list[Event]:
        """The events that ``text``, the output's next piece, makes sure of."""
        self.text += text
        while getattr(self, "_" + self.state)():
            pass
        events, self.events = self.events, []
        return events

    def finish(self) -> list[Event]:
        """The last events, once the output is complete."""
        if not self.well_formed and self.state != "content" and (
                self.calls == 0 or self.state not in ("call", "open_call")):
            self._fail(keep=self.emitted if self.calls == 0 else self.pos)
        self._flush_content(len(self.text))
        events, self.events = self.events, []
        return events

    @property
    def well_formed(self) -> bool:
        """Whether the output so far is one or more whole calls (with content before them
        where the format allows it)."""
        return not self.failed and self.calls > 0 and self.state in self._FINAL

    _FINAL: ClassVar[tuple[str, ...]] = ()
    """The states in which the output read so far is whole calls."""

    def _content(self) -> bool:
        self._flush_content(len(self.text))
        self.pos = len(self.text)
        return False

    def _flush_content(self, end: int) -> None:
        if self.state == "content" or self.calls == 0:
            if end > self.emitted:
                self.events.append(Content(self.text[self.emitted:end]))
            self.emitted = max(self.emitted, end)

    def _fail(self, keep: int) -> None:
        self.failed = True
        self.state = "content"
        self.call = None
        self.emitted = keep

    def _skip_whitespace(self) -> str:
        """The next character that is not whitespace ("" at the end of the text so far)."""
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _call(self) -> bool:
        if self.call is None:
            self.call = CallReader(self.arguments_keys)
        call, announced = self.call, self.call.name is not None
        limit, closed = self._call_limit()
        self.pos = call.feed(self.text, self.pos, limit)
        cut = closed and not call.done and self.pos == limit
        call.failed = call.failed or cut
        if call.name is not None and not announced:
            self.events.append(CallStart(self.calls, call.name))
            self.calls += 1
        arguments = call.take_arguments()
        if arguments:
            self.events.append(Arguments(self.calls - 1, arguments))
        if call.failed:
            # Content from the character that broke the call (consumed unless it was cut).
            self._fail(keep=self.emitted if self.calls == 0 else self.pos - (not cut))
            return True
        if call.done:
            self.call, self.state = None, "after_call"
            return True
        return False


    def _call_limit(self) -> tuple[int, bool]:
        """How far the call may read, and whether the format ends it there."""
        return len(self.text), False


class RequiredReader(ToolCallReader):
    """``tool_choice: required``: a JSON list of ``{"name", "parameters"}``."""

    _FINAL = ("end",)

    def __init__(self) -> None:
        super().__init__(arguments_keys=("parameters",))

    def _lead(self) -> bool:
        return self._expect("[", "call")

    def _after_call(self) -> bool:
        ch = self._skip_whitespace()
        if ch in ",]" and ch:
            self.pos += 1
            self.state = "call" if ch == "," else "end"
            return True
        return self._expect("", "")

    def _end(self) -> bool:
        return self._expect("", "")

    def _expect(self, char: str, state: str) -> bool:
        ch = self._skip_whitespace()
        if not ch:
            return False
        if char and ch == char:
            self.pos, self.state = self.pos + 1, state
        else:
            self._fail(keep=self.emitted if self.calls == 0 else self.pos)
        return True


class Llama3JsonReader(ToolCallReader):
    """Llama 3.x: the whole output is one JSON object ``{"name": ..., "parameters": {...}}``
    (or several separated by ``;``), optionally after ``<|python_tag|>``."""

    TAG = "<|python_tag|>"
    _FINAL = ("after_call",)

    def _lead(self) -> bool:
        ch = self._skip_whitespace()
        rest = self.text[self.pos:]
        if rest.startswith(self.TAG):
            self.pos, self.state = self.pos + len(self.TAG), "open_call"
            return True
        if not ch or self.TAG.startswith(rest):
            return False  # may yet become a call: nothing is content so far
        self.state = "call" if ch == "{" else "content"
        return True

    def _open_call(self) -> bool:
        ch = self._skip_whitespace()
        if ch:
            self.state = "call" if ch == "{" else "content"
        return bool(ch)

    def _after_call(self) -> bool:
        while self._skip_whitespace() == ";":
            self.pos += 1
        ch = self._skip_whitespace()
        if ch == "{":
            self.state = "call"
        elif ch:
            self._fail(keep=self.pos)
        return bool(ch)


class HermesReader(ToolCallReader):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them,
    after optional content (its trailing whitespace dropped). Text between and after calls
    is dropped, as vLLM does; the last call may lack its end tag."""

    START, END = "<tool_call>", "</tool_call>"
    _FINAL = ("after_call", "between")

    def _lead(self) -> bool:
        start = self.text.find(self.START, self.pos)
        if start < 0:
            end = len(self.text) - _prefix_overlap(self.text, self.START)
            self._send_content(end)
            return False
        self._send_content(start)
        self.pos, self.state = start + len(self.START), "open_call"
        return True

    def _send_content(self, end: int) -> None:
        # Whitespace just before a call is no part of the content: held until text follows.
        piece = self.text[self.emitted:end].rstrip(WHITESPACE)
        if piece:
            self.events.append(Content(piece))
            self.emitted += len(piece)
        self.pos = max(self.pos, self.emitted)

    def _open_call(self) -> bool:
        if self._skip_whitespace():
            self.state = "call"
            return True
        return False

    def _call_limit(self) -> tuple[int, bool]:
        # The end tag ends the call's text (a call left open there is malformed); text that
        # may begin the end tag waits.
        end = self.text.find(self.END, self.pos)
        if end >= 0:
            return end, True
        return len(self.text) - _prefix_overlap(self.text, self.END), False

    def _after_call(self) -> bool:
        ch = self._skip_whitespace()
        rest = self.text[self.pos:self.pos + len(self.END)]
        if not ch or (self.END.startswith(rest) and len(rest) < len(self.END)):
            return False
        if rest != self.END:
            self._fail(keep=self.pos)
            return True
        self.pos, self.state = self.pos + len(self.END), "between"
        return True

    def _between(self) -> bool:
        start = self.text.find(self.START, self.pos)
        if start < 0:
            self.pos = max(self.pos, len(self.text) - _prefix_overlap(self.text, self.START))
            return False
        self.pos, self.state = start + len(self.START), "open_call"
        return True


READERS: dict[str, type[ToolCallReader]] = {"llama3_json": Llama3JsonReader,
                                            "hermes": HermesReader}


def read_whole(reader: ToolCallReader, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished output as (content, tool calls): the whole text as content and no calls
    unless it is well-formed calls."""
    events = reader.push(text) + reader.finish()
    if not reader.well_formed:
        return text, []
    names: list[str] = []
    arguments: list[str] = []
    for event in events:
        if isinstance(event, CallStart):
            names.append(event.name)
            arguments.append("")
        elif isinstance(event, Arguments):
            arguments[event.index] += event.text
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content or None, [ToolCall(n, a) for n, a in zip(names, arguments, strict=True)]
