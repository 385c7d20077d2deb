"""The prefix cache's block hashes, torch-free, for whoever must name a prompt's blocks outside
the scheduler (the tokenizer's router).

The chain is the one of scheduler/core/block_manager.py (hash_block): a full block of block_size
tokens is named by hash((parent's hash, tuple(its token ids))). Python hashes tuples of ints
without the PYTHONHASHSEED salt, so every process computes the same names.
tests/test_prefix_hashes.py keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of token_ids (at most max_blocks of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    out: list[int] = []
    parent = None
    for i in range(count):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out
