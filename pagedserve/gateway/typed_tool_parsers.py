"""Tool-call parsers whose calls are read a block at a time (--tool-call-parser, vLLM's names),
the formats whose arguments are values, not JSON text: each value is read (typed by the tool's
schema, or as a Python literal) and the arguments written out by json.dumps:

  qwen3_coder   `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...</function>\\n</tool_call>`
                (XML; values typed by the tool's parameters schema: integer, number, boolean,
                object, array; a string otherwise), several, text before them content.
  pythonic      the output is a Python list of calls, `[f(a=1, b="x"), g()]` (Llama 3.2), literal
                arguments only; output that does not start with `[` is content.

The machinery (content, blocks, streaming: BlockParser, with its contract) is block_parser.py;
the registry of block parsers (BLOCK_PARSERS) block_tool_parsers.py. Streamed, a call goes out
once its first parameter (keyword argument), or its clean end, is whole, so a block that turns out
not to be a call is never announced; then `{"key": value` at each complete parameter, as json.dumps
writes it, `, "key": value` after, and `}` at the call's end.
Plain Python, one parser object per sample. Threads: the gateway's event loop.
"""

from __future__ import annotations

import ast
import json
import re

from pagedserve.gateway.block_parser import BlockParser


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

