"""CallScanner: one tool call's JSON object, read character by character as it streams in (the
tool-call parsers' shared part, pagedserve/gateway/tool_parsers.py).

It finds where the object ends, its top-level keys, the `name` string as soon as it is complete,
and the span of the arguments' value (`"arguments"`, or Llama's `"parameters"`: whichever comes
first) as it grows. The top level is checked strictly, so a malformed one fails at the character
that breaks it; nested values only for balance (strings, escapes, brackets), and json.loads judges
the whole object at its end. Plain Python, one object per call; each character is looked at once,
and the text is kept as the pieces it came in (_Text), so a call's cost is linear in its length
however many pieces it streams in (a long run of forced whitespace included).
"""

from __future__ import annotations

import json
from bisect import bisect_right

_ARGUMENT_KEYS = ("arguments", "parameters")


def _string(text: str) -> str | None:
    """A JSON string literal's value; None when it is not one (a bad escape)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _Text:
    """Text kept as the pieces it came in: appending costs the piece, a slice joins only the
    pieces it spans, and the whole is joined once when asked for."""

    __slots__ = ("pieces", "starts", "length")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.starts: list[int] = []
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.starts.append(self.length)
            self.length += len(piece)

    def slice(self, start: int, end: int) -> str:
        end = min(end, self.length)
        if start >= end:
            return ""
        i = bisect_right(self.starts, start) - 1
        out = []
        while i < len(self.pieces) and self.starts[i] < end:
            base = self.starts[i]
            out.append(self.pieces[i][max(start - base, 0):end - base])
            i += 1
        return "".join(out)

    def truncate(self, length: int) -> None:
        whole = self.slice(0, length)
        self.pieces, self.starts, self.length = ([whole], [0], len(whole)) if whole else ([], [], 0)

    def whole(self) -> str:
        if len(self.pieces) > 1:
            self.truncate(self.length)
        return self.pieces[0] if self.pieces else ""


class CallScanner:
    """One JSON object, character by character: where it ends, its top-level keys, the `name`
    string and the span of the arguments' value. The top level is checked strictly (a malformed
    one fails at once); nested values only for balance: json.loads judges the whole at the end."""

    __slots__ = ("_text", "depth", "in_str", "esc", "expect", "key", "key_start", "value_start",
                 "value_kind", "last", "name", "args_key", "args_start", "args_end", "failed", "done")

    def __init__(self) -> None:
        self._text = _Text()
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
        base = self._text.length
        self._text.append(piece)
        for i, ch in enumerate(piece):
            pos = base + i
            if not self._step(ch, pos):
                self.failed = True
                self._text.truncate(pos)
                return piece[i:]
            if self.done:
                self._text.truncate(pos + 1)
                return piece[i + 1:]
        return ""

    @property
    def text(self) -> str:
        """The object's text read so far (joined when asked for: not per piece)."""
        return self._text.whole()

    def slice(self, start: int, end: int) -> str:
        return self._text.slice(start, end)

    def _value_end(self, end: int) -> bool:
        if self.key == "name" and self.value_kind == "str":
            self.name = _string(self._text.slice(self.value_start, end))
            if self.name is None:
                return False
        elif self.key == self.args_key:
            self.args_end = end
        self.expect = "comma"
        return True

    def _step(self, ch: str, pos: int) -> bool:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                self.last = pos
                if self.expect == "keystr":
                    self.key, self.expect = _string(self._text.slice(self.key_start, pos + 1)), "colon"
                    return self.key is not None
                if self.expect == "valstr":
                    return self._value_end(pos + 1)
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
                    return self._value_end(pos + 1)
            return True
        if expect == "scalar":
            if ch not in ",}":
                self.last = pos
                return True
            if not self._value_end(self.last + 1):
                return False
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

    def streamable_end(self) -> int:
        """Where the arguments' text that can go out now ends (an object's, up to its last
        non-space); -1 while there is none."""
        if self.args_start < 0 or self._text.slice(self.args_start, self.args_start + 1) != "{":
            return -1
        return self.args_end if self.args_end >= 0 else self.last + 1

    def result(self) -> tuple[str, str] | None:
        """(name, arguments) of a complete, valid call object, else None."""
        try:
            obj = json.loads(self.text)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than json can read
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
