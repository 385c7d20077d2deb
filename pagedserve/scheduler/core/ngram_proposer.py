"""N-gram proposals (prompt lookup, vLLM's "ngram" method): the tokens that followed an earlier
occurrence of the sequence's own suffix, in its prompt and output so far.

Rule: the longest suffix of n tokens (prompt_lookup_min <= n <= prompt_lookup_max) that occurs
earlier in the sequence wins; among its occurrences the earliest (as vLLM's); the proposal is the
(up to) k tokens that followed it. No match: no proposal.

Pure functions on numpy arrays, no state: one vectorised pass over the sequence (every position
whose token equals the last one), then narrowing that candidate set one token back at a time, so
a step costs O(length) numpy work per request, not a Python loop over the sequence.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The proposal for a sequence (tokens: 1-D integer array, prompt + output); empty if none."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return tokens[:0]
    # ends: positions e < length - 1 where tokens[e - n + 1 .. e] equals the suffix of n tokens.
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    best = ends if min_n <= 1 else None
    n = 1
    while n < max_n and n <= length - 2 and ends.size:
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        n += 1
        if n >= min_n and ends.size:
            best = ends
    if best is None or not best.size:
        return tokens[:0]
    start = int(best[0]) + 1
    return tokens[start:start + k]


class TokenArrays:
    """Each sequence's tokens as a growing numpy array (appended to, never rebuilt), so proposing
    does not convert the whole Python list every step. A sequence's tokens only ever grow while it
    lives; keep_only drops the arrays of sequences that are gone (every step), so a reused id starts
    afresh. Owner: the scheduler's thread."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, seq_id: str, token_ids: list[int]) -> np.ndarray:
        buf, used = self._arrays.get(seq_id, (None, 0))
        length = len(token_ids)
        if buf is None or used > length:
            buf, used = np.empty(max(64, 2 * length), dtype=np.int64), 0
        if length > len(buf):
            grown = np.empty(2 * length, dtype=np.int64)
            grown[:used] = buf[:used]
            buf = grown
        if length > used:
            buf[used:length] = token_ids[used:length]
        self._arrays[seq_id] = (buf, length)
        return buf[:length]

    def keep_only(self, live: set[str] | dict) -> None:
        for seq_id in [s for s in self._arrays if s not in live]:
            del self._arrays[seq_id]
