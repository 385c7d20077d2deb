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
array of {"name", "parameters"}). Plain Python, no state shared between objects; a call's JSON is
read by call_scanner.CallScanner, once per character of the call (never over the vocabulary).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pagedserve.gateway.call_scanner import CallScanner

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


class ToolParser(ABC):
    """See the module docstring for the contract. Subclasses frame the calls in the text (tags,
    separators) with the helpers here: _content, _start_call, _feed_call, _end_content."""

    name: ClassVar[str] = ""

    def __init__(self, stream: bool = True, max_calls: int | None = None) -> None:
        self.stream, self.max_calls = stream, max_calls
        self.events: list[Event] = []
        self.calls = 0  # calls begun (announced in a stream, valid when whole): the next index
        self._buf = ""
        # whitespace after content: content if more follows, else dropped. Pieces, joined once
        # content follows: a run of whitespace costs its length, never its length per delta.
        self._pending_ws: list[str] = []
        self._after_call = False
        self._call: CallScanner | None = None
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
        if text.isspace():
            self._pending_ws.append(text)
            return
        body = text.rstrip()
        if body:
            self.events.append(Event(content="".join(self._pending_ws) + body))
            self._pending_ws = [text[len(body):]] if len(body) < len(text) else []

    def _end_content(self) -> None:
        if self._buf:
            self._content(self._buf)
            self._buf = ""
        if self.calls == 0 and self._pending_ws:
            self.events.append(Event(content="".join(self._pending_ws)))
        self._pending_ws = []

    # -- calls ------------------------------------------------------------------------------
    def _start_call(self, prefix: str) -> None:
        self._call, self._call_prefix, self._index, self._args_sent = CallScanner(), prefix, None, 0

    def _announce(self, name: str) -> None:
        if self.max_calls is not None and self.calls >= self.max_calls:
            self._index = -1
            return
        self._index = self.calls
        self.calls += 1
        self._pending_ws = []
        self.events.append(Event(index=self._index, id=new_call_id(), name=name))

    def _send_arguments(self, text: str | CallScanner, start: int = 0, end: int | None = None) -> None:
        """Send what is new of the arguments text[start:end] (only the new part is sliced; a
        call's text is sliced in place, never joined whole)."""
        end = len(text) if end is None else end
        if self._index is not None and self._index >= 0 and end - start > self._args_sent:
            new = start + self._args_sent
            piece = text.slice(new, end) if isinstance(text, CallScanner) else text[new:end]
            self.events.append(Event(index=self._index, arguments=piece))
            self._args_sent = end - start

    def _feed_call(self, text: str) -> tuple[str, str]:
        """Feed the open call; ("more", ""), ("done", rest) or ("failed", rest). A failed call
        that was never announced is content again."""
        call = self._call
        rest = call.feed(text)
        if self.stream and not call.failed:
            if self._index is None and call.name:
                self._announce(call.name)
            end = call.streamable_end()
            if end >= 0:
                self._send_arguments(call, call.args_start, end)
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

    def __init__(self, stream: bool = True, max_calls: int | None = None) -> None:
        super().__init__(stream, max_calls)
        self._state = "start"  # start, between (after a call), text
        # At the start: the whitespace and opening read so far (pieces, so that a run of
        # whitespace costs its length once), and whether the opening was among them.
        self._lead: list[str] = []
        self._opened = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf:
            if self._call is not None:
                status, self._buf = self._feed_call(self._buf)
                if status == "more":
                    break
                self._state = "between" if status == "done" else "text"
            elif self._state == "start":
                if not self._read_start():
                    break
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

    def _read_start(self) -> bool:
        """Read the start of the output in the buffer: its whitespace and opening go to _lead;
        then a call opens, or everything read is text. False while it is too short to tell."""
        s = self._buf.lstrip()
        if len(s) < len(self._buf):
            self._lead.append(self._buf[:len(self._buf) - len(s)])
            self._buf = s
        if not s:
            return False
        if not self._opened and self.OPEN:
            if s.startswith(self.OPEN):
                self._lead.append(self.OPEN)
                self._buf, self._opened = s[len(self.OPEN):], True
                return True
            if self.OPEN.startswith(s):
                return False
            if self.OPEN_REQUIRED:
                return self._start_is_text()
        if s[0] != "{":
            return self._start_is_text()
        self._start_call("".join(self._lead))
        self._lead = []
        return True

    def _start_is_text(self) -> bool:
        self._buf, self._lead, self._state = "".join(self._lead) + self._buf, [], "text"
        return True

    def finish(self) -> list[Event]:
        if self._call is not None:
            self._fail_call()
        if self._state == "start" and (self._buf or self._lead):
            self._start_is_text()
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
        self._parts: list[str] = []

    def feed(self, text: str) -> list[Event]:
        if self._index is None and not self._parts:  # leading whitespace is no part of the arguments
            text = text.lstrip()
        if not text:
            return self._take()
        # Streamed, only trailing whitespace waits in _parts; whole, everything (joined once).
        if not self.stream or text.isspace():
            self._parts.append(text)
            return self._take()
        body = text.rstrip()
        if self._index is None:
            self._announce(self.function)
        self.events.append(Event(index=self._index, arguments="".join(self._parts) + body))
        self._args_sent += 1
        self._parts = [text[len(body):]] if len(body) < len(text) else []
        return self._take()

    def finish(self) -> list[Event]:
        if self._index is None:
            self._announce(self.function)
        body = "".join(self._parts).rstrip() if not self.stream else ""
        if body or not self._args_sent:
            self.events.append(Event(index=self._index, arguments=body or "{}"))
        return self._take()


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}
