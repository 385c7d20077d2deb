"""Reasoning parsers (--reasoning-parser, vLLM's names): a chat sample's text -> the reasoning
(message.reasoning_content) and the content after it, whole or streamed.

  deepseek_r1   the output starts in the reasoning (DeepSeek-R1's template ends the prompt with
                `<think>`); a leading `<think>` is dropped; `</think>` ends the reasoning; output
                that never writes `</think>` is reasoning only (content null).
  qwen3         the output is reasoning only when it starts with `<think>` (Qwen3 with thinking on);
                then `</think>` ends it as above. Output that does not start with `<think>` (thinking
                off: enable_thinking false puts an empty block in the prompt) is content only.

The contract is the tool parsers': one ReasoningSplitter per sample; `feed(text)` takes the next
piece of text in any split and returns the (reasoning, content) it settles; `finish()` returns what
was held back. A tag split across pieces is held until it is known to be a tag or not, so any split
of a text gives the same two strings as the whole text (`split(text)`). Tool calls and the content's
other readings (tools.py) apply to the content only. A request whose chat_template_kwargs set
enable_thinking (or thinking) false is read as content only, whatever the parser.
Plain Python, no I/O, no state shared between objects. Threads: the gateway's event loop.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a proper start of tag (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One sample's text, read as (reasoning, content) pieces. States: "start" (the opening tag
    not yet decided), "reasoning", "content"."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self.parser = parser
        self.state = "start"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        buf = self.held + text
        self.held = ""
        if self.state == "start":
            if START.startswith(buf):  # maybe the opening tag: wait for more
                self.held = buf
                return "", ""
            if buf.startswith(START):
                buf, self.state = buf[len(START):], "reasoning"
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            at = buf.find(END)
            if at < 0:
                keep = _partial_suffix(buf, END)
                self.held = buf[len(buf) - keep:] if keep else ""
                return buf[:len(buf) - keep], ""
            reasoning, buf, self.state = buf[:at], buf[at + len(END):], "content"
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the text: what was held back goes to the state it was held in."""
        held, self.held = self.held, ""
        if self.state == "start":
            # Only a proper start of "<think>" (or nothing) was held: deepseek_r1 reads it as
            # reasoning, qwen3 as content.
            return (held, "") if self.parser == "deepseek_r1" else ("", held)
        return (held, "") if self.state == "reasoning" else ("", held)


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole text -> (reasoning_content, content), each None when empty (vLLM's message)."""
    splitter = ReasoningSplitter(parser)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def thinking_disabled(chat_template_kwargs: dict | None) -> bool:
    """chat_template_kwargs {"enable_thinking": false} (Qwen3) or {"thinking": false} (DeepSeek V3.1)."""
    kwargs = chat_template_kwargs or {}
    return kwargs.get("enable_thinking", True) is False or kwargs.get("thinking", True) is False


def request_parser(configured: str | None, chat_template_kwargs: dict | None) -> str | None:
    """The parser a chat request's samples are read with: the server's, unless the request turned
    thinking off."""
    if configured is None or thinking_disabled(chat_template_kwargs):
        return None
    return configured
