"""Logprobs in the answer's shapes, from the tokenizer service's TokenLogprob entries: OpenAI's chat
("content" entries with bytes and top_logprobs) and completions (tokens, token_logprobs,
top_logprobs, text_offset) forms, vLLM's prompt_logprobs, and vLLM's return_tokens_as_token_ids.
Pure functions; -inf (JSON has none) and NaN are clamped as vLLM clamps them."""

from __future__ import annotations

import math
from collections.abc import Iterable

from pagedserve.v1 import common_pb2

# JSON has no -inf; vLLM clamps a logprob the same way so that strict JSON parsers accept it.
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    if math.isnan(value):
        return MIN_LOGPROB
    return max(value, MIN_LOGPROB)


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def show_ids_as_tokens(entries: Iterable[common_pb2.TokenLogprob]) -> None:
    """vLLM's return_tokens_as_token_ids, in place: every token string (the sampled one's and its
    alternatives') becomes "token_id:<id>", so that tokens that are not whole characters can be told
    apart (the bytes and text offsets are then those of that string, as vLLM's)."""
    for e in entries:
        e.token = f"token_id:{e.token_id}"
        for t in e.top:
            t.token = f"token_id:{t.token_id}"


def chat_logprobs(entries: Iterable[common_pb2.TokenLogprob]) -> dict:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    return {"content": [
        {"token": e.token, "logprob": clamp_logprob(e.logprob), "bytes": _token_bytes(e.token),
         "top_logprobs": [{"token": t.token, "logprob": clamp_logprob(t.logprob), "bytes": _token_bytes(t.token)}
                          for t in e.top]}
        for e in entries]}


class CompletionLogprobs:
    """OpenAI completions format. text_offset counts characters into the choice's text, so the
    running offset (which starts after an echoed prompt) is kept across a stream's chunks."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def build(self, entries: Iterable[common_pb2.TokenLogprob], prompt: Iterable[common_pb2.TokenLogprob] = ()) -> dict:
        """prompt: an echoed prompt's entries (GenerateResponse.prompt_logprobs), listed first; its
        first token has no logprob (None), as OpenAI and vLLM answer."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        prompt = list(prompt)
        if prompt:
            first = prompt.pop(0)
            out["tokens"].append(first.token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(self.offset)
            self.offset += len(first.token)
        for e in [*prompt, *entries]:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(clamp_logprob(e.logprob))
            # Like vLLM: the sampled token is listed among the alternatives even when not in the top k.
            top = {t.token: clamp_logprob(t.logprob) for t in e.top}
            top.setdefault(e.token, clamp_logprob(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def vllm_prompt_logprobs(entries: Iterable[common_pb2.TokenLogprob]) -> list[dict | None]:
    """vLLM's choice "prompt_logprobs": None for the first token, then per position
    {token_id: {logprob, rank, decoded_token}}: the prompt token first, then the top k."""
    entries = list(entries)
    out: list[dict | None] = [None] if entries else []
    for e in entries[1:]:
        position = {str(e.token_id): {"logprob": clamp_logprob(e.logprob), "rank": e.rank or None,
                                      "decoded_token": e.token}}
        for rank, t in enumerate(e.top, start=1):
            position.setdefault(str(t.token_id), {"logprob": clamp_logprob(t.logprob), "rank": rank,
                                                  "decoded_token": t.token})
        out.append(position)
    return out
