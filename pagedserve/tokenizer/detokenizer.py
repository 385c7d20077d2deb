"""Incremental detokenization and stop strings: plain classes, no gRPC.

Both classes work on one sample's stream. The detokenizer turns token ids into text deltas that
never split a multi-byte character; the stop-string matcher turns text deltas into the text the
client sees, holding back just enough to catch a stop string split across deltas.
"""

from __future__ import annotations

# How many prompt tokens the decode window starts with: enough context that the first output
# token decodes as it would mid-text (a leading space kept, a merged byte sequence right),
# the same number vLLM uses (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_OFFSET = 5

REPLACEMENT_CHAR = "\ufffd"


def rust_decoder(tokenizer):
    """The `tokenizers.Tokenizer` under a transformers fast tokenizer, when decoding through it
    gives the same text as `tokenizer.decode`: it does unless the wrapper cleans up spaces after
    decoding. Two decodes a token straight in Rust cost ~3 us against ~9 us through the wrapper's
    Python (SmolLM2's tokenizer, 2026-12-03); None: decode through the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Text deltas for a growing list of output token ids.

    The windowed method of TGI and vLLM: `prefix_offset:read_offset` is text already emitted
    (kept only as decoding context), `read_offset:` is new. Decoding both windows and emitting
    the difference costs O(window) per token. When the new text ends in U+FFFD the last token
    holds an incomplete UTF-8 sequence, so it waits for the bytes that complete it.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "prefix_offset", "read_offset", "_prefix_text",
                 "_backend")

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = rust_decoder(tokenizer)
        context = list(prompt_token_ids[-INITIAL_OFFSET:])
        prefix_text = self._decode(context)
        if prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the first output bytes would complete it and
            # rewrite text we treat as already emitted, so decode the output on its own instead.
            context, prefix_text = [], ""
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = prefix_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids) -> str:
        """Append new_token_ids; return the text they complete (possibly "")."""
        self.ids.extend(new_token_ids)
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text):]
        # Slide the window: what was new is now the context of the next token.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        # Drop ids that left the window so a long output does not keep them all.
        if self.prefix_offset > 0:
            del self.ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return delta

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(self._prefix_text):] if len(new_text) > len(self._prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = ""
        self.ids = []
        return delta


class StopStringMatcher:
    """Cuts a sample's text at the first stop string.

    Only a suffix of the text that is a proper prefix of some stop string is held back, so text
    flows with no delay unless it could be the start of a stop string, and an occurrence can only
    begin inside held-back text plus the new delta: that is all feed() searches.
    """

    __slots__ = ("stop", "include_stop_str_in_output", "_held", "stopped", "stop_str")

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.stop_str: str | None = None

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Return (text to emit, whether a stop string was hit). After a hit nothing more is emitted."""
        if self.stopped:
            return "", True
        if not self.stop:
            return text_delta, False
        text = self._held + text_delta
        hit_at, hit = -1, ""
        for s in self.stop:
            i = text.find(s)
            # The earliest start wins; at one start the shorter string completed first.
            if i != -1 and (hit_at == -1 or i < hit_at or (i == hit_at and len(s) < len(hit))):
                hit_at, hit = i, s
        if hit_at != -1:
            self.stopped, self.stop_str, self._held = True, hit, ""
            end = hit_at + len(hit) if self.include_stop_str_in_output else hit_at
            return text[:end], True
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At a normal finish the held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class SampleText:
    """One sample's token ids to the text the client sees: detokenizer, then stop strings."""

    __slots__ = ("detok", "matcher")

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stop, include_stop_str_in_output)

    def push(self, token_ids, final: bool = False) -> tuple[str, int, bool]:
        """(text, how many of token_ids were used, whether a stop string hit). Token by token, so
        the ids used end at the one that completed a stop string; final flushes what was held."""
        parts: list[str] = []
        for used, tid in enumerate(token_ids, 1):
            text, stopped = self.matcher.feed(self.detok.step((tid,)))
            parts.append(text)
            if stopped:
                return "".join(parts), used, True
        if final:
            text, stopped = self.matcher.feed(self.detok.flush())
            parts.append(text)
            if stopped:
                return "".join(parts), len(token_ids), True
            parts.append(self.matcher.flush())
        return "".join(parts), len(token_ids), False
