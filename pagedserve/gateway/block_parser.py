"""BlockParser: the machinery shared by the tool-call parsers whose calls are read a block at a
time (block_tool_parsers.py: mistral, deepseek_v3, granite; typed_tool_parsers.py: qwen3_coder,
pythonic).

The ToolParser contract (tool_parsers.py) holds: any split of a text gives the content and calls
of the whole text. A block (a region of calls) is read when its end is seen (or at the end of the
output, where a block whose calls are complete is read as calls): its calls, each its name and its
arguments. Streamed, a parser with a view of the open block (view_block: deepseek_v3, mistral (both
forms), granite, qwen3_coder, pythonic) sends each call's name once it is whole and its arguments as
OpenAI-shaped deltas as they come (deepseek_v3, mistral and granite: the JSON text as written;
qwen3_coder: `{"key": value` at each complete parameter, then `, "key": value`, `}` at the block's
end; pythonic the same at each complete keyword argument, `}` at its call's `)`). A block that does
not parse is content (whole and streamed alike when nothing of it went out; a stream cannot take
back a call it announced: that call ends with the arguments sent, as hermes'). Text before a block
streams as content as it comes, holding back only what may begin one of the block's tags (START,
ALSO_STARTS; LEADING opens a block only at the output's start). Plain Python,
one parser object per sample, no state shared between objects. Threads: the gateway's event loop.
"""

from __future__ import annotations

from typing import ClassVar

from pagedserve.gateway.tool_parsers import Event, ToolParser, _held


class BlockParser(ToolParser):
    """Content, then blocks of calls between START and END (END None: the block runs to the end
    of the output). Subclasses give read_block(text) -> [(name, arguments JSON)] or None."""

    START: ClassVar[str] = ""
    ALSO_STARTS: ClassVar[tuple[str, ...]] = ()  # other openings, as START (not with AT_START_ONLY)
    END: ClassVar[str | None] = None
    AT_START_ONLY: ClassVar[bool] = False  # the block may only open the output (after whitespace)
    # Text that opens a block when the output starts with it (after whitespace) and stays the block's
    # first text (granite's bare list, when its <|tool_call|> token was skipped as special).
    LEADING: ClassVar[str] = ""

    def __init__(self, stream: bool = True, max_calls: int | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        super().__init__(stream, max_calls)
        self.schemas = schemas or {}
        self._block: list[str] | None = None  # the open block's text, in pieces
        self._opening = self.START  # what opened the open block (content again if it does not parse)
        self._seen_text = False  # whether the output's first non-whitespace character has come
        self._streamed: list[tuple[int, int]] = []  # the open block's announced calls: (index, args sent)

    def read_block(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    def _starts(self) -> tuple[str, ...]:
        return (self.START, *self.ALSO_STARTS)

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
            if self.LEADING and not self._seen_text:
                s = self._buf.lstrip()
                if not s or (len(s) < len(self.LEADING) and self.LEADING.startswith(s)):
                    break  # too short to tell
                self._seen_text = True
                if s.startswith(self.LEADING):
                    self._content(self._buf[:len(self._buf) - len(s)])
                    self._buf, self._block, self._opening = s, [], ""
                    continue
            if self.AT_START_ONLY:
                at, opening = (len(self._buf) - len(self._buf.lstrip()) if self._buf.lstrip().startswith(self.START)
                               else -1), self.START
            else:
                at, opening = min(((i, tag) for tag in self._starts() if (i := self._buf.find(tag)) >= 0),
                                  default=(-1, ""))
            if at >= 0:
                self._content(self._buf[:at])
                self._buf, self._block, self._opening = self._buf[at + len(opening):], [], opening
                continue
            if self.AT_START_ONLY:
                s = self._buf.lstrip()
                if not s or self.START.startswith(s):
                    break  # too short to tell
                self._seen_text = True
                continue
            keep = len(self._buf) - max(_held(self._buf, tag) for tag in self._starts())
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
                self._content(self._opening + whole)
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
