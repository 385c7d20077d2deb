"""Server-sent events: the framing of one event, the stream position a client resumes from
(`Cursor`, the SSE event id), the skipping of what a resumed client already has (`ResumeSkip`),
and the response that cancels its gRPC call the moment it ends (`CancellingStream`).

Threads: used on the serving event loop only. Invariants: by default no event has an `id:` line
(OpenAI's bytes); when there is one, it is the Cursor *after* the
event's message (so resuming after it never repeats nor drops a token or character); `[DONE]`
and in-band errors carry no id.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from pagedserve.v1 import generate_pb2

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no cache or proxy buffering of a stream


# json.dumps with any option builds a new encoder per call; one shared encoder writes the same
# bytes (a JSONEncoder keeps no state between calls) for a fraction of the cost per chunk.
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse_event(data: dict, event_id: str | None = None) -> str:
    if event_id is None:
        return f"data: {_ENCODE(data)}\n\n"
    return f"id: {event_id}\ndata: {_ENCODE(data)}\n\n"


class CancellingStream(StreamingResponse):
    """SSE response that cancels the gRPC call the moment the response ends for any reason.
    Starlette stops iterating the body when the client disconnects, but an async generator left
    suspended at a `yield` is only closed whenever it is garbage-collected; this does it at once."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


class Cursor:
    """Where a client is in a stream: per sample, the tokens and the characters of text it has
    received, and whether it saw the sample's last chunk. It is the SSE event id, sent when the
    client opts in (stream_options.include_event_ids) and always on a resumed stream:
    `T:C` per sample (`T:C:f` once finished), samples joined by commas, e.g. `12:45` or `12:45:f,7:30`.
    GET /v1/requests/{id}/stream resumes after it (Last-Event-ID, or ?after=T[,T...] in tokens)."""

    def __init__(self, n: int) -> None:
        self.tokens, self.chars, self.done = [0] * n, [0] * n, [False] * n

    def grow(self, index: int) -> None:
        while index >= len(self.tokens):
            self.tokens.append(0)
            self.chars.append(0)
            self.done.append(False)

    def advance(self, msg: generate_pb2.GenerateResponse) -> None:
        """Count msg as received by the client."""
        i = msg.index
        self.tokens[i] += len(msg.token_ids)
        self.chars[i] += len(msg.text)
        if msg.finish_reason:
            self.done[i] = True

    def event_id(self) -> str:
        return ",".join(f"{t}:{c}" + (":f" if d else "") for t, c, d in zip(self.tokens, self.chars, self.done))

    @staticmethod
    def parse(text: str) -> tuple[list[int], list[int | None], list[bool]]:
        """(tokens, chars or None when not given, finished) per sample; raises ValueError."""
        tokens, chars, done = [], [], []
        for part in text.strip().split(","):
            fields = part.strip().split(":")
            if not 1 <= len(fields) <= 3 or (len(fields) == 3 and fields[2] != "f"):
                raise ValueError(part)
            t = int(fields[0])
            c = int(fields[1]) if len(fields) >= 2 else None
            if t < 0 or (c is not None and c < 0):
                raise ValueError(part)
            tokens.append(t)
            chars.append(c)
            done.append(len(fields) == 3)
        if len(tokens) > 1024:
            raise ValueError("too many samples")
        return tokens, chars, done


class ResumeSkip:
    """Drops from a replayed stream what the client already has (its Cursor), cutting a message
    that straddles the cursor at the exact token and character. `tokenizer` (the Tokenizer stub)
    is asked to detokenize only when the client's position is in tokens alone (?after=T)."""

    def __init__(self, tokenizer, tokens: list[int], chars: list[int | None], done: list[bool],
                 skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special_tokens
        self.tokens, self.chars, self.done = tokens, chars, done
        self.ids: dict[int, list[int]] = {}  # output ids so far, kept only while chars are unknown

    async def apply(self, msg: generate_pb2.GenerateResponse, cursor: Cursor):
        """The part of msg to send (or None); `cursor` holds the counts before msg."""
        i = msg.index
        if i >= len(self.tokens):
            return msg
        if self.done[i]:
            return None
        seen_t, seen_c = cursor.tokens[i], cursor.chars[i]
        ids, text = list(msg.token_ids), msg.text
        if self.chars[i] is None:
            if seen_t + len(ids) >= self.tokens[i]:
                if seen_t + len(ids) == self.tokens[i]:
                    self.chars[i] = seen_c + len(text)
                else:
                    known = self.ids.get(i, []) + ids[:max(0, self.tokens[i] - seen_t)]
                    self.chars[i] = await self._text_length(known)
                self.ids.pop(i, None)
            else:
                self.ids.setdefault(i, []).extend(ids)
                return None if not msg.finish_reason else self._cut(msg, len(ids), len(text))
        tok_cut = min(max(0, self.tokens[i] - seen_t), len(ids))
        char_cut = min(max(0, self.chars[i] - seen_c), len(text))
        if tok_cut == 0 and char_cut == 0:
            return msg
        return self._cut(msg, tok_cut, char_cut)

    @staticmethod
    def _cut(msg: generate_pb2.GenerateResponse, tok_cut: int, char_cut: int):
        out = generate_pb2.GenerateResponse()
        out.CopyFrom(msg)
        out.text = msg.text[char_cut:]
        del out.token_ids[:]
        out.token_ids.extend(msg.token_ids[tok_cut:])
        if len(msg.logprobs) == len(msg.token_ids):
            del out.logprobs[:]
            out.logprobs.extend(msg.logprobs[tok_cut:])
        if not out.text and not out.token_ids and not out.finish_reason:
            return None
        return out

    async def _text_length(self, ids: list[int]) -> int:
        reply = await self.tokenizer.Detokenize(
            generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=self.skip_special), timeout=5.0)
        return len(reply.text)
