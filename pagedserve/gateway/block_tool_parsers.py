"""Tool-call parsers whose calls are read a block at a time (--tool-call-parser, vLLM's names),
the formats whose arguments are JSON text as the model wrote it, and the registry of every block
parser (BLOCK_PARSERS):

  mistral       `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer tokenizers'
                `[TOOL_CALLS]name[ARGS]{...}` (repeated); text before [TOOL_CALLS] is content; the
                calls run to the end of the output.
  deepseek_v3   `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; text before it is content.
  granite       Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (`<tool_call>[...]` too,
                and `<|tool_call|><tool_call>[...]`), text before the marker content; or the output is the
                bare list (after whitespace): what is left when `<|tool_call|>`, a special token, is
                skipped (skip_special_tokens, as in vLLM). The list runs to the end of the output:
                text after it, or a list that does not parse, makes the marker and all after it content
                (an output that starts with `[` streams as content only at its end, as pythonic's).

The block formats whose arguments are values written out by json.dumps (qwen3_coder, pythonic) are
in typed_tool_parsers.py; the machinery all share (content, blocks, streaming: BlockParser, with
its contract) in block_parser.py. Streamed, these three send a call's arguments as the JSON text
written, as it comes. Plain Python, one parser object per sample. Threads: the gateway's event loop.
"""

from __future__ import annotations

import json
import re

from pagedserve.gateway.block_parser import BlockParser
from pagedserve.gateway.call_scanner import CallScanner
from pagedserve.gateway.tool_parsers import _held
from pagedserve.gateway.typed_tool_parsers import PythonicParser, Qwen3CoderParser


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
    """mistral's and granite's `[{"name": ..., "arguments": {...}}, ...]`, each element read by a CallScanner (the
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


class GraniteParser(BlockParser):
    name = "granite"
    START, ALSO_STARTS, END = "<|tool_call|>", ("<tool_call>",), None
    LEADING = "["

    def _list(self, text: str) -> str | None:
        """The block's text from its `[` on; None when it is not a list."""
        s = text.lstrip()
        if self._opening == self.START:
            s = s.removeprefix(self.ALSO_STARTS[0]).lstrip()
        return s if s.startswith("[") else None

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        s = self._list(text)
        return _json_list(s.rstrip(), final=True) if s is not None else None

    def view_block(self, text: str) -> list[tuple[str, str]]:
        s = self._list(text)
        return _json_list(s, final=False) if s is not None else []


BLOCK_PARSERS: dict[str, type[BlockParser]] = {p.name: p for p in (MistralParser, DeepSeekV3Parser,
                                                                    Qwen3CoderParser, PythonicParser, GraniteParser)}
