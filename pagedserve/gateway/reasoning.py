"""Reasoning parsers (--reasoning-parser, vLLM's names): a chat sample's text -> the reasoning
(message.reasoning_content) and the content after it, whole or streamed.

  deepseek_r1   the output starts in the reasoning (DeepSeek-R1's template ends the prompt with
                `<think>`); a leading `<think>` is dropped; `</think>` ends the reasoning; output
                that never writes `</think>` is reasoning only (content null).
  qwen3         the output is reasoning only when it starts with `<think>` (Qwen3 with thinking on);
                then `</think>` ends it as above. Output that does not start with `<think>` (thinking
                off: enable_thinking false puts an empty block in the prompt) is content only.
  granite       Granite 3.2's plain-text markers: the output is reasoning only when it starts with
                "Here is my thought process:" (or "Here's my thought process:", as quantized models
                write it; thinking is on with chat_template_kwargs {"thinking": true}); "Here is my
                response:" (or "Here's my response:") ends it; otherwise as qwen3. The markers are
                dropped, the text between them kept as written. vLLM's whole answer gives all content
                when the response marker never comes; here, as its stream does, it is reasoning only.

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
# parser -> (the openings, the endings, whether output without an opening starts in the reasoning)
_MARKERS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "deepseek_r1": ((START,), (END,), True),
    "qwen3": ((START,), (END,), False),
    "granite": (("Here is my thought process:", "Here's my thought process:"),
                ("Here is my response:", "Here's my response:"), False),
}
PARSERS = tuple(_MARKERS)


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of text that is a proper start of one of tags (held back)."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(len(t) > n and text.endswith(t[:n]) for t in tags):
            return n
    return 0


def structured_end(parser: str) -> str:
    """The text after which structured outputs and forced tool calls constrain the output (vLLM's
    behaviour): `</think>`; "" for granite, whose markers are plain text that a model with thinking
    off never writes: there the constraint holds from the first token."""
    return "" if parser == "granite" else END


class ReasoningSplitter:
    """One sample's text, read as (reasoning, content) pieces. States: "start" (the opening tag
    not yet decided), "reasoning", "content"."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        self.parser = parser
        self.starts, self.ends, self.implicit = _MARKERS[parser]
        self.state = "start"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        buf = self.held + text
        self.held = ""
        if self.state == "start":
            if any(tag.startswith(buf) for tag in self.starts):  # maybe the opening tag: wait for more
                self.held = buf
                return "", ""
            opening = next((tag for tag in self.starts if buf.startswith(tag)), None)
            if opening is not None:
                buf, self.state = buf[len(opening):], "reasoning"
            else:
                self.state = "reasoning" if self.implicit else "content"
        if self.state == "reasoning":
            found = [(at, tag) for tag in self.ends if (at := buf.find(tag)) >= 0]
            if not found:
                keep = _partial_suffix(buf, self.ends)
                self.held = buf[len(buf) - keep:] if keep else ""
                return buf[:len(buf) - keep], ""
            at, tag = min(found)
            reasoning, buf, self.state = buf[:at], buf[at + len(tag):], "content"
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the text: what was held back goes to the state it was held in."""
        held, self.held = self.held, ""
        if self.state == "start":
            # Only a proper start of an opening (or nothing) was held: deepseek_r1 reads it as
            # reasoning, the others as content.
            return (held, "") if self.implicit else ("", held)
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
