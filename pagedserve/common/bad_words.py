"""vLLM's bad_words as token sequences, and the tokens they forbid at a step. Pure functions.

A word is forbidden at the start of the text and in its middle: it is encoded as written (its
leading spaces dropped) and once more after a space, the second kept only where the space makes a
different first token of the same length (vLLM's rule, so that "Paris" and " Paris" are both
caught by a byte-level BPE whose words carry their space). At a step, a sequence forbids its last
token where the output so far ends with the rest of it; a one-token sequence forbids its token
everywhere. Only the output is read, not the prompt (vLLM's).

Users: the tokenizer service and the offline engine (`token_sequences`, given the tokenizer's
encode without special tokens); the worker's sampler (`forbidden`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.common.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS


def token_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The sequences of words (raises ValueError naming bad_words for an empty or too long word,
    or too many words)."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words has {len(words)} words: at most {MAX_BAD_WORDS}")
    out: list[list[int]] = []
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words[{i}] must be a word (a non-blank string), got {word!r}")
        plain = list(encode(word.lstrip()))
        spaced = list(encode(" " + word.lstrip()))
        if len(plain) > MAX_BAD_WORD_TOKENS or len(spaced) > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words[{i}] is {max(len(plain), len(spaced))} tokens long: at most "
                             f"{MAX_BAD_WORD_TOKENS}")
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def forbidden(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens the sequences forbid after `output` (the tokens generated so far)."""
    out = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(seq[:prefix]):
            out.append(seq[-1])
    return out
