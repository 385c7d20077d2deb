"""Tool-call parsers whose calls are read a block at a time (--tool-call-parser, vLLM's names):

  mistral       `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer tokenizers'
                `[TOOL_CALLS]name[ARGS]{...}` (repeated); text before [TOOL_CALLS] is content; the
                calls run to the end of the output.
  deepseek_v3   `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; text before it is content.
  qwen3_coder   `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...</function>\\n</tool_call>`
                (XML; values typed by the tool's parameters schema: integer, number, boolean,
                object, array; a string otherwise), several, text before them content.
  pythonic      the output is a Python list of calls, `[f(a=1, b="x"), g()]` (Llama 3.2), literal
                arguments only; output that does not start with `[` is content.

The ToolParser contract (tool_parsers.py) holds: any split of a text gives the content and calls
of the whole text. A block (a region of calls) is read when its end is seen (or at the end of the
output, where a block whose calls are complete is read as calls): its calls, each its name and its
arguments. Streamed, a parser with a view of the open block (view_block: deepseek_v3, mistral (both
forms), qwen3_coder, pythonic) sends each call's name once it is whole and its arguments as OpenAI-shaped
deltas as they come (deepseek_v3 and mistral: the JSON text as written; qwen3_coder: `{"key": value`
at each complete parameter, then `, "key": value`, `}` at the block's end; pythonic the same at
each complete keyword argument, `}` at its call's `)`). A block that does
not parse is content (whole and streamed alike when nothing of it went out; a stream cannot take
back a call it announced: that call ends with the arguments sent, as hermes'). Text before a block
streams as content as it comes, holding back only what may begin the block's tag. Plain Python.
"""

from __future__ import annotations

import ast
import json
import re
from typing import ClassVar

from pagedserve.gateway.call_scanner import CallScanner
from pagedserve.gateway.tool_parsers import Event, ToolParser, _held


class BlockParser(ToolParser):
    """Content, then blocks of calls between START and END (END None: the block runs to the end
    of the output). Subclasses give read_block(text) -> [(name, arguments JSON)] or None."""

    START: ClassVar[str] = ""
    END: ClassVar[str | None] = None
    AT_START_ONLY: ClassVar[bool] = False  # the block may only open the output (after whitespace)

    def __init__(self, stream: bool = True, max_calls: int | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        super().__init__(stream, max_calls)
        self.schemas = schemas or {}
        self._block: list[str] | None = None  # the open block's text, in pieces
        self._seen_text = False
        self._streamed: list[tuple[int, int]] = []  # the open block's announced calls: (index, args sent)

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    def view_block(self, text: str) -> list[tuple[str, str]]:
        """An open block's calls so far: (name, a prefix of the arguments text read_block will give),
        for the calls whose name is whole. Default: none (the block's calls go out at its end)."""
        return []

    def _stream_view(self, text: str) -> None:
        for i, (name, arguments) in enumerate(self.view_block(text)):
            if i == len(self._streamed):
                self._args_sent = 0
                self._announce(name)
                self._streamed.append((self._index, 0))
            self._index, self._args_sent = self._streamed[i]
            self._send_arguments(arguments)
            self._streamed[i] = (self._index, self._args_sent)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf:
            if self._block is not None:
                if self.END is None:
                    self._block.append(self._buf)
                    self._buf = ""
                    if self.stream:
                        self._stream_view("".join(self._block))
                    break
                joined = "".join(self._block) + self._buf  # the block is short: joined once per piece
                at = joined.find(self.END)
                if at < 0:
                    self._block, self._buf = [joined], ""
                    if self.stream:
                        self._stream_view(joined)
                    break
                self._block = None
                self._close(joined[:at], joined[:at + len(self.END)])
                self._buf = joined[at + len(self.END):]
                continue
            if self.AT_START_ONLY and self._seen_text:
                self._content(self._buf)
                self._buf = ""
                break
            at = self._buf.find(self.START) if not self.AT_START_ONLY else \
                (len(self._buf) - len(self._buf.lstrip()) if self._buf.lstrip().startswith(self.START) else -1)
            if at >= 0:
                self._content(self._buf[:at])
                self._buf, self._block = self._buf[at + len(self.START):], []
                continue
            if self.AT_START_ONLY:
                s = self._buf.lstrip()
                if not s or self.START.startswith(s):
                    break  # too short to tell
                self._seen_text = True
                continue
            keep = len(self._buf) - _held(self._buf, self.START)
            self._content(self._buf[:keep])
            self._buf = self._buf[keep:]
            break
        return self._take()

    def _close(self, body: str, whole: str) -> None:
        """A block's text is complete: its calls, or (when it does not parse) the text as content."""
        calls = self.read_block(body)
        streamed, self._streamed = self._streamed, []
        if calls is None:
            if streamed:  # announced: those calls end as sent
                self._after_call = True
            else:
                self._content(self.START + whole)
            return
        for i, (name, arguments) in enumerate(calls):
            if i < len(streamed):
                self._index, self._args_sent = streamed[i]
            else:
                self._args_sent = 0
                self._announce(name)
            self._send_arguments(arguments)
        self._after_call = True

    def finish(self) -> list[Event]:
        if self._block is not None:  # (cut off before its END: calls if they are complete, else text)
            body, self._block = "".join(self._block), None
            self._close(body, body)
        elif self.AT_START_ONLY and not self._seen_text and self._buf.strip():
            self._content(self._buf)
            self._buf = ""
        self._end_content()
        return self._take()


def _object_text(value) -> str | None:
    """Arguments as JSON text: an object given as one (serialized), or JSON text of one (as the model
    wrote it, stripped: what a stream sent of it is its prefix)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return value.strip() if isinstance(parsed, dict) else None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _open_prefix(text: str, stop: str) -> str:
    """What of an open call's arguments text can go out: stripped, less what may begin `stop`."""
    return text[:len(text) - _held(text, stop)].strip()


class MistralParser(BlockParser):
    name = "mistral"
    START, END = "[TOOL_CALLS]", None
    _ARGS = "[ARGS]"

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        s = text.strip()
        if s.startswith("["):
            return _json_list(s, final=True)
        out = []
        for part in s.split(self.START):  # name[ARGS]{...}, repeated with [TOOL_CALLS] between
            name, sep, arguments = part.partition(self._ARGS)
            text_args = _object_text(arguments.strip()) if sep else None
            if not name.strip() or text_args is None:
                return None
            out.append((name.strip(), text_args))
        return out


    def view_block(self, text: str) -> list[tuple[str, str]]:
        s = text.lstrip()
        if not s:
            return []
        if s.startswith("["):
            return _json_list(s, final=False)
        out, parts = [], s.split(self.START)
        for k, part in enumerate(parts):
            name, sep, arguments = part.partition(self._ARGS)
            if not sep or not name.strip():
                break
            last = k == len(parts) - 1
            out.append((name.strip(), _open_prefix(arguments, self.START) if last else arguments.strip()))
        return out


def _json_list(text: str, final: bool) -> list[tuple[str, str]] | None:
    """mistral's `[{"name": ..., "arguments": {...}}, ...]`, each element read by a CallScanner (the
    arguments' JSON text as written). final: the calls of a whole valid list, else None; not final:
    the calls so far, the open one's arguments as far as they can go out."""
    out, rest = [], text[1:]
    while True:
        rest = rest.lstrip()
        if not rest:
            break
        scanner = CallScanner()
        rest = scanner.feed(rest)
        if scanner.failed:
            break
        if not scanner.done:
            end = scanner.streamable_end()  # announced once its arguments open as an object
            if not final and scanner.name and end >= 0:
                out.append((scanner.name, scanner.slice(scanner.args_start, end)))
            break
        found = scanner.result()
        arguments = _object_text(found[1]) if found is not None else None
        if arguments is None:
            break
        out.append((found[0], arguments))
        rest = rest.lstrip()
        if rest.startswith(","):
            rest = rest[1:]
            continue
        if rest.startswith("]") and not rest[1:].strip():
            return out
        break
    return None if final else out


class DeepSeekV3Parser(BlockParser):
    name = "deepseek_v3"
    START, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
                       r"\s*<｜tool▁call▁end｜>", re.DOTALL)

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        out, at = [], 0
        for match in self._CALL.finditer(text):
            if text[at:match.start()].strip():
                return None
            arguments = _object_text(match["args"])
            if arguments is None or not match["name"].strip():
                return None
            out.append((match["name"].strip(), arguments))
            at = match.end()
        return out if out and not text[at:].strip() else None

    _HEAD = re.compile(r"\s*<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>[^\n]*)\n```json\n", re.DOTALL)
    _CALL_END = "<｜tool▁call▁end｜>"

    def view_block(self, text: str) -> list[tuple[str, str]]:
        out, at = [], 0
        while (head := self._HEAD.match(text, at)) is not None and head["name"].strip():
            end = text.find("\n```", head.end())
            if end < 0:
                out.append((head["name"].strip(), _open_prefix(text[head.end():], "\n```")))
                break
            out.append((head["name"].strip(), text[head.end():end].strip()))
            close = text.find(self._CALL_END, end)
            if close < 0:
                break
            at = close + len(self._CALL_END)
        return out


class Qwen3CoderParser(BlockParser):
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.DOTALL)

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        match = self._FUNCTION.fullmatch(text)
        if match is None:
            return None
        name = match["name"].strip()
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments, at = {}, 0
        for p in self._PARAMETER.finditer(match["body"]):
            if match["body"][at:p.start()].strip():
                return None
            key = p["key"].strip()
            arguments[key] = _typed(p["value"], (properties.get(key) or {}).get("type"))
            at = p.end()
        if match["body"][at:].strip():
            return None
        return [(name, json.dumps(arguments, ensure_ascii=False))]

    _HEAD = re.compile(r"\s*<function=(?P<name>[^>\n]+)>")

    def view_block(self, text: str) -> list[tuple[str, str]]:
        """The call once its first parameter (or its clean end) is whole, so a block that turns out
        not to be a call is never announced; then each complete parameter, as json.dumps writes it."""
        head = self._HEAD.match(text)
        if head is None:
            return []
        name, body = head["name"].strip(), text[head.end():]
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        pieces, at = [], 0
        for p in self._PARAMETER.finditer(body):
            if body[at:p.start()].strip():
                break
            key = p["key"].strip()
            value = _typed(p["value"], (properties.get(key) or {}).get("type"))
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            at = p.end()
        if pieces:
            return [(name, "{" + ", ".join(pieces))]
        return [(name, "")] if body.lstrip().startswith("</function>") else []


def _typed(value: str, kind) -> object:
    """A qwen3_coder parameter's text as its schema's type says (the text itself when it does not fit)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "null" in kinds and value.strip() == "null":
        return None
    for k in kinds:
        try:
            if k == "integer":
                return int(value.strip())
            if k == "number":
                number = float(value.strip())
                return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() \
                    else number
            if k == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if k in ("object", "array"):
                return json.loads(value)
        except ValueError:
            continue
    return value


class PythonicParser(BlockParser):
    name = "pythonic"
    START, END = "[", None
    AT_START_ONLY = True

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        source = "[" + text.rstrip()
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        out = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
            except ValueError:
                return None
            if len(arguments) != len(call.keywords):
                return None
            out.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
        return out


    _CALL_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
    _KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")

    def view_block(self, text: str) -> list[tuple[str, str]]:
        """The calls so far, each once a keyword argument (or its closing parenthesis) is whole:
        `{"key": value` per complete keyword as json.dumps writes the literal, `}` at its `)`."""
        out, at = [], 0
        while (head := self._CALL_HEAD.match(text, at)) is not None:
            pieces, pos, closed = [], head.end(), False
            while True:
                keyword = self._KEYWORD.match(text, pos)
                if keyword is None:
                    rest = text[pos:].lstrip()
                    closed = rest.startswith(")")
                    pos = len(text) - len(rest) + 1
                    break
                end = _python_value_end(text, keyword.end())
                if end < 0:
                    break
                try:
                    value = json.dumps(ast.literal_eval(text[keyword.end():end].strip()), ensure_ascii=False)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    return out
                pieces.append(f"{json.dumps(keyword[1], ensure_ascii=False)}: {value}")
                pos = end + 1 if text[end] == "," else end
            if not pieces and not closed:
                break
            out.append((head[1], "{" + ", ".join(pieces) + ("}" if closed else "")))
            rest = text[pos:].lstrip()
            if not closed or not rest.startswith(","):
                break
            at = len(text) - len(rest) + 1
        return out


def _python_value_end(text: str, start: int) -> int:
    """Where a keyword argument's value that starts at `start` ends: the index of the `,` or `)`
    after it at its own level (strings and brackets skipped), or -1 while it is not complete."""
    depth, quote, i = 0, "", start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i if ch == ")" else -1
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return -1


BLOCK_PARSERS: dict[str, type[BlockParser]] = {p.name: p for p in (MistralParser, DeepSeekV3Parser,
                                                                    Qwen3CoderParser, PythonicParser)}
