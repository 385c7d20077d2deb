"""The prefix cache's block hashes, torch-free: one definition for the scheduler's block manager
(scheduler/core/block_manager.py) and for whoever must name a prompt's blocks outside the
scheduler (the tokenizer's router).

A full block of block_size tokens is named by sha256 over its parent's name and its token ids
(little-endian uint32), the first block's parent being the request's cache salt; the name is the
digest's first 128 bits, as an int. So a block's name names its whole prefix and the salt, and
finding two prefixes with one name takes ~2^64 sha256 work (vLLM moved from Python's hash() to
sha256 after CVE-2025-25183: hash() of a tuple of ints can be collided on purpose, and a collision
serves one prompt another's KV). Every process computes the same names (no PYTHONHASHSEED).

The salt (SamplingParams.cache_salt) scopes the cache: the gateway sets it to the request's owner
(`--prefix-cache-scope owner`, the default) and the client's `cache_salt`, so requests share cached
blocks only with requests of the same owner and salt. About 0.7 us a block (16 tokens), against
0.1 us for hash(): once per full block of a sequence. tests/test_replica_routing.py keeps the
router's and the block manager's names equal.

Images (common/multimodal.py): every image's placeholders are the same token, so the block that holds
an image's first placeholder hashes the image's content hash too (`extras`, image_extras); the chain
carries it to every later block, as vLLM's extra keys do.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

_FIRST, _NEXT = b"\x00", b"\x01"


def prefix_salt(cache_salt: str, lora_name: str = "", lora_path: str = "") -> str:
    """A request's prefix-cache scope: its cache_salt, and its LoRA adapter when it has one (an
    adapter's KV differs from the base model's for the same tokens). From the SamplingParams
    dataclass (its prefix_salt) and from its proto alike (the tokenizer's replica router)."""
    return f"{cache_salt}\x00lora:{lora_name}@{lora_path}" if lora_name else cache_salt


def image_extras(images, block_size: int) -> dict[int, bytes]:
    """Block index -> the content hashes of the images whose first placeholder it holds (ImageInputs, or
    their protos: anything with an offset and a hex hash)."""
    extras: dict[int, bytes] = {}
    for image in images:
        index = image.offset // block_size
        extras[index] = extras.get(index, b"") + bytes.fromhex(image.hash)
    return extras


def hash_block(parent_hash: int | None, token_ids: Sequence[int], salt: str = "", extra: bytes = b"") -> int:
    """The name of the block token_ids whose parent block is named parent_hash (None: the first
    block, under salt); extra: what else its content depends on (images starting in it)."""
    if parent_hash is None:
        salted = salt.encode()
        head = _FIRST + len(salted).to_bytes(4, "little") + salted
    else:
        head = _NEXT + parent_hash.to_bytes(16, "little")
    tail = b"\x02" + extra if extra else b""
    digest = hashlib.sha256(head + struct.pack(f"<{len(token_ids)}I", *token_ids) + tail).digest()
    return int.from_bytes(digest[:16], "little")


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                 salt: str = "", extras: Mapping[int, bytes] | None = None) -> list[int]:
    """The chained hashes of the full blocks of token_ids (at most max_blocks of them)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    out: list[int] = []
    parent = None
    for i in range(count):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt,
                            extras.get(i, b"") if extras else b"")
        out.append(parent)
    return out
