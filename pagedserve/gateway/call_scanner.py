"""CallScanner: one tool call's JSON object, read character by character as it streams in (the
tool-call parsers' shared part, pagedserve/gateway/tool_parsers.py).

It finds where the object ends, its top-level keys, the `name` string as soon as it is complete,
and the span of the arguments' value (`"arguments"`, or Llama's `"parameters"`: whichever comes
first) as it grows. The top level is checked strictly, so a malformed one fails at the character
that breaks it; nested values only for balance (strings, escapes, brackets), and json.loads judges
the whole object at its end. Plain Python, one object per call; each character is looked at once.
"""

from __future__ import annotations

import json

_ARGUMENT_KEYS = ("arguments", "parameters")


def _string(text: str) -> str | None:
    """A JSON string literal's value; None when it is not one (a bad escape)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class CallScanner:
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

    def _value_end(self, end: int) -> bool:
        if self.key == "name" and self.value_kind == "str":
            self.name = _string(self.text[self.value_start:end])
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
                    self.key, self.expect = _string(self.text[self.key_start:pos + 1]), "colon"
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
        if self.args_start < 0 or self.text[self.args_start] != "{":
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
