"""Tool-call parsers: a model's output text -> content and tool calls, whole or streamed.

The contract (ToolParser): one parser object per sample. `feed(text)` takes the next piece of the
sample's text, in any split, and returns the events that piece settles; `finish()` ends the text
and returns the rest. Events, in order:
  - Event(content=...): text for message.content;
  - Event(index=i, id=..., name=...): tool call i begins (its name is whole, never split);
  - Event(index=i, arguments=...): the next fragment of call i's arguments (JSON text).
A call's arguments are the JSON text the model wrote for them (`"arguments"`, or Llama's
`"parameters"`: whichever key comes first), not re-serialized, so a stream's fragments can be
sent as they come and still add up to the non-streamed answer: `parse(text)` is the same
machine fed the whole text, and assembles the same calls (ids aside) as any split of it.

Streamed (`stream=True`), a call is announced once its name is complete and its arguments follow
as they arrive; whole (`stream=False`), a call counts only once its JSON is complete and valid.
Malformed JSON is content (the text as the model wrote it) in both modes, except that a stream
cannot take back a call it announced: a stream whose call breaks after its name (bad JSON late in
the object, or output cut off by max_tokens) ends that call with the arguments sent so far, where
the whole answer would have given the text as content. Whitespace between content and calls is
dropped; content with no calls is the text exactly. `max_calls` (parallel_tool_calls=false) keeps
the first call and drops later ones.

Formats: `hermes` (Hermes, Qwen2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
content before, several calls), `llama3_json` (Llama 3.x: the output is `{"name": ..., "parameters":
{...}}`, several separated by `;`, optionally after `<|python_tag|>`; output not starting with `{` is
content), and two used for forced tool_choice, whose output a JSON schema constrains:
NamedCallParser (the output is the named function's arguments) and RequiredCallsParser (a JSON
array of {"name", "parameters"}). Plain Python, no state shared between objects; the JSON scanning
runs once per character of a call (never over the vocabulary).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

_ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class Event:
    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def assemble(events: list[Event]) -> Parsed:
    """Events -> content and calls, as an OpenAI client's stream helpers put the deltas together."""
    out = Parsed()
    for e in events:
        if e.content is not None:
            out.content += e.content
        elif e.name is not None:
            out.calls.append(ToolCall(e.id or "", e.name))
        elif e.arguments is not None:
            out.calls[e.index].arguments += e.arguments
    return out


def _held(buf: str, tag: str) -> int:
    """How many characters at the end of buf could begin tag (kept back until the next piece)."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class _CallScanner:
    """One JSON object, character by character: where it ends, its top-level keys, the `name`
    string and the span of the arguments' value. The top level is checked strictly (a malformed
    one fails at once); nested values only for balance: json.loads judges the whole at the end."""

    __slots__ = ("text", "depth", "in_str", "esc", "expect", "key", "key_start", "value_start",
                 "value_kind", "last", "name", "args_key", "args_start", "args_end", "failed", "done")

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.expect = "open"  # open, keystr, colon, value, valstr, nested, scalar, comma
        self.key: str | None = None
        self.key_start = self.value_start = self.last = 0
        self.value_kind = ""
        self.name: str | None = None
        self.args_key: str | None = None
        self.args_start = self.args_end = -1  # end -1: the arguments' value is not complete
        self.failed = self.done = False

    def feed(self, piece: str) -> str:
        """Scan piece; returns what follows the object (or the failing character on)."""
        base = len(self.text)
        self.text += piece
        for i, ch in enumerate(piece):
            pos = base + i
            if not self._step(ch, pos):
                self.failed = True
                self.text = self.text[:pos]
                return piece[i:]
            if self.done:
                self.text = self.text[:pos + 1]
                return piece[i + 1:]
        return ""

    def _value_end(self, end: int) -> None:
        if self.key == "name" and self.value_kind == "str":
            self.name = json.loads(self.text[self.value_start:end])
        elif self.key == self.args_key:
            self.args_end = end
        self.expect = "comma"

    def _step(self, ch: str, pos: int) -> bool:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.expect == "keystr":
                    self.key, self.expect = json.loads(self.text[self.key_start:pos + 1]), "colon"
                elif self.expect == "valstr":
                    self._value_end(pos + 1)
            self.last = pos
            return True
        if ch.isspace():
            return True
        expect = self.expect
        if expect == "nested":
            self.last = pos
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_end(pos + 1)
            return True
        if expect == "scalar":
            if ch not in ",}":
                self.last = pos
                return True
            self._value_end(self.last + 1)
            expect = "comma"
        if expect == "open":
            self.depth, self.expect = 1, "key"
            return ch == "{"
        if expect == "key":
            if ch == "}" and self.key is None:  # {}
                self.done = True
                return True
            self.key_start, self.expect, self.in_str = pos, "keystr", True
            return ch == '"'
        if expect == "colon":
            self.expect = "value"
            return ch == ":"
        if expect == "value":
            self.value_start = self.last = pos
            if self.key in _ARGUMENT_KEYS and self.args_key is None:
                self.args_key, self.args_start = self.key, pos
            if ch == '"':
                self.value_kind, self.expect, self.in_str = "str", "valstr", True
            elif ch in "{[":
                self.value_kind, self.expect, self.depth = "nested", "nested", 2
            elif ch in ",}:]":
                return False
            else:
                self.value_kind, self.expect = "scalar", "scalar"
            return True
        # comma
        if ch == ",":
            self.expect = "key"
            return True
        if ch == "}":
            self.done = True
            return True
        return False

    def streamable_arguments(self) -> str:
        """The arguments' text that can go out now: an object's text up to its last non-space."""
        if self.args_start < 0 or self.text[self.args_start] != "{":
            return ""
        end = self.args_end if self.args_end >= 0 else self.last + 1
        return self.text[self.args_start:end]

    def result(self) -> tuple[str, str] | None:
        """(name, arguments) of a complete, valid call object, else None."""
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        if self.args_key is None:
            return obj["name"], "{}"
        value = obj[self.args_key]
        if isinstance(value, dict):
            return obj["name"], self.text[self.args_start:self.args_end]
        if isinstance(value, str):  # some models write the arguments as a JSON string
            return obj["name"], value
        return None


class ToolParser(ABC):
    """See the module docstring for the contract. Subclasses frame the calls in the text (tags,
    separators) with the helpers here: _content, _start_call, _feed_call, _end_content."""

    name: ClassVar[str] = ""

    def __init__(self, stream: bool = True, max_calls: int | None = None) -> None:
        self.stream, self.max_calls = stream, max_calls
        self.events: list[Event] = []
        self.calls = 0  # calls begun (announced in a stream, valid when whole): the next index
        self._buf = ""
        self._pending_ws = ""  # whitespace after content: content if more follows, else dropped
        self._after_call = False
        self._call: _CallScanner | None = None
        self._call_prefix = ""  # the text that opened the call (its tag), content again if it fails
        self._index: int | None = None  # the call's index once announced; -1: dropped (max_calls)
        self._args_sent = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events this piece of text settles."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The end of the text: the events still held back."""

    @classmethod
    def parse(cls, text: str, max_calls: int | None = None) -> Parsed:
        parser = cls(stream=False, max_calls=max_calls)
        return assemble(parser.feed(text) + parser.finish())

    def _take(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    # -- content ----------------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        if body:
            self.events.append(Event(content=body))

    def _end_content(self) -> None:
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        if self.calls == 0 and self._pending_ws:
            self.events.append(Event(content=self._pending_ws))
        self._pending_ws = ""

    # -- calls ------------------------------------------------------------------------------
    def _start_call(self, prefix: str) -> None:
        self._call, self._call_prefix, self._index, self._args_sent = _CallScanner(), prefix, None, 0

    def _announce(self, name: str) -> None:
        if self.max_calls is not None and self.calls >= self.max_calls:
            self._index = -1
            return
        self._index = self.calls
        self.calls += 1
        self._pending_ws = ""
        self.events.append(Event(index=self._index, id=new_call_id(), name=name))

    def _send_arguments(self, text: str) -> None:
        if self._index is not None and self._index >= 0 and len(text) > self._args_sent:
            self.events.append(Event(index=self._index, arguments=text[self._args_sent:]))
            self._args_sent = len(text)

    def _feed_call(self, text: str) -> tuple[str, str]:
        """Feed the open call; ("more", ""), ("done", rest) or ("failed", rest). A failed call
        that was never announced is content again."""
        call = self._call
        rest = call.feed(text)
        if self.stream and not call.failed:
            if self._index is None and call.name:
                self._announce(call.name)
            self._send_arguments(call.streamable_arguments())
        if not call.done and not call.failed:
            return "more", ""
        found = call.result() if call.done else None
        if found is not None:
            if self._index is None:
                self._announce(found[0])
            self._send_arguments(found[1])
            self._call, self._after_call = None, True
            return "done", rest
        self._fail_call()
        return "failed", rest

    def _fail_call(self) -> None:
        call, self._call = self._call, None
        if self._index is None:  # nothing of it went out: it is text
            self._content(self._call_prefix + call.text)
        else:
            self._after_call = True


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, stream: bool = True, max_calls: int | None = None) -> None:
        super().__init__(stream, max_calls)
        self._state = "text"  # text, or "after" a call (its end tag, another call, or text)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while True:
            if self._call is not None:
                status, self._buf = self._feed_call(self._buf)
                if status == "more":
                    break
                self._state = "after" if status == "done" else "text"
            elif self._state == "after":
                s = self._buf.lstrip()
                if not s:
                    self._buf = ""
                    break
                for tag in (self.END, self.START):
                    if s.startswith(tag):
                        self._buf, self._state = s[len(tag):], "text"
                        if tag == self.START:
                            self._start_call(tag)
                        break
                else:
                    if self.END.startswith(s) or self.START.startswith(s):
                        self._buf = s
                        break
                    self._buf, self._state = s, "text"
            else:
                i = self._buf.find(self.START)
                if i >= 0:
                    self._content(self._buf[:i])
                    self._buf = self._buf[i + len(self.START):]
                    self._start_call(self.START)
                    continue
                keep = len(self._buf) - _held(self._buf, self.START)
                self._content(self._buf[:keep])
                self._buf = self._buf[keep:]
                break
        return self._take()

    def finish(self) -> list[Event]:
        if self._call is not None:  # cut off inside a call
            self._fail_call()
        if self._state == "after":
            self._buf = ""
        self._end_content()
        return self._take()


class _JsonCallsParser(ToolParser):
    """Calls as bare JSON objects: an optional opening, then objects between separators, then an
    optional closing; anything else is content."""

    OPEN, SEP, CLOSE = "", ";", ""
    OPEN_REQUIRED = False
    _WAIT = ("", "")

    def __init__(self, stream: bool = True, max_calls: int | None = None) -> None:
        super().__init__(stream, max_calls)
        self._state = "start"  # start, between (after a call), text

    def _open(self, s: str) -> tuple[str, str] | None:
        """(prefix, the first call's text) when s opens the calls, None when it cannot, _WAIT
        while it is too short to tell."""
        rest = s
        if self.OPEN and s.startswith(self.OPEN):
            rest = s[len(self.OPEN):].lstrip()
        elif self.OPEN.startswith(s):
            return self._WAIT
        elif self.OPEN_REQUIRED:
            return None
        if not rest:
            return self._WAIT
        return (s[:len(s) - len(rest)], rest) if rest[0] == "{" else None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf:
            if self._call is not None:
                status, self._buf = self._feed_call(self._buf)
                if status == "more":
                    break
                self._state = "between" if status == "done" else "text"
            elif self._state == "start":
                s = self._buf.lstrip()
                if not s:
                    break
                opened = self._open(s)
                if opened == self._WAIT:
                    break
                if opened is None:
                    self._state = "text"
                    continue
                self._start_call(self._buf[:len(self._buf) - len(opened[1])])
                self._buf = opened[1]
            elif self._state == "between":
                s = self._buf.lstrip()
                if s and s.startswith(self.SEP):
                    self._buf = s[len(self.SEP):]
                    self._start_call(self.SEP)
                elif s and self.CLOSE and s.startswith(self.CLOSE):
                    self._buf, self._state = s[len(self.CLOSE):], "text"
                else:
                    self._buf = s
                    if not s:
                        break
                    self._state = "text"
            else:
                self._content(self._buf)
                self._buf = ""
        return self._take()

    def finish(self) -> list[Event]:
        if self._call is not None:
            self._fail_call()
        if self._state == "start" and self._buf:
            self._state = "text"
        self._end_content()
        return self._take()


class Llama3JsonParser(_JsonCallsParser):
    name = "llama3_json"
    OPEN = "<|python_tag|>"


class RequiredCallsParser(_JsonCallsParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} objects."""

    name = "required"
    OPEN, SEP, CLOSE = "[", ",", "]"
    OPEN_REQUIRED = True


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the whole output is that function's arguments."""

    name = "named"

    def __init__(self, function: str, stream: bool = True, max_calls: int | None = None) -> None:
        super().__init__(stream, max_calls)
        self.function = function

    @classmethod
    def parse_named(cls, function: str, text: str) -> Parsed:
        parser = cls(function, stream=False)
        return assemble(parser.feed(text) + parser.finish())

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        body = self._buf.strip()
        if self.stream and body:
            if self._index is None:
                self._announce(self.function)
            self._send_arguments(body)
        return self._take()

    def finish(self) -> list[Event]:
        if self._index is None:
            self._announce(self.function)
        self._send_arguments(self._buf.strip() or "{}")
        return self._take()


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}
