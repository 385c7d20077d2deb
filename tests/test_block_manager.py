"""The block manager: prefix caching (hits, chained hashes, eviction, capacity), fork and
copy-on-write, swapping, and a regression. The same under random sequences of calls:
tests/test_block_manager_machine.py."""

from __future__ import annotations

import pytest

from block_checks import snapshot
from pagedserve.scheduler.core.block_manager import BlockManager, hash_block


# ---- BlockManager: prefix caching ---------------------------------------------------------------

def _run_seq(bm: BlockManager, seq_id: str, tokens: list[int]):
    hits = bm.find_cached_prefix(seq_id, tokens)
    computed = len(hits) * bm.block_size
    assert bm.allocate_slots(seq_id, computed, len(tokens) - computed, hits) is not None
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    return hits


def test_prefix_hit_for_a_second_sequence_with_the_same_prefix():
    bm = BlockManager(16, 4)
    prompt = list(range(10))  # two full blocks and a partial one
    assert _run_seq(bm, "a", prompt) == []
    a_blocks = bm.tables["a"]
    hits = bm.find_cached_prefix("b", prompt[:8] + [99, 98, 97])
    assert hits == a_blocks[:2]
    assert bm.allocate_slots("b", 8, 3, hits) is not None
    assert bm.tables["b"][:2] == a_blocks[:2] and bm.tables["b"][2] is not a_blocks[2]
    assert [b.ref_count for b in a_blocks[:2]] == [2, 2]
    # Still findable after both are freed (they sit in the free queue with their hashes).
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 16
    assert bm.find_cached_prefix("c", prompt) == a_blocks[:2]


def test_block_hashes_chain_over_the_prefix():
    bm = BlockManager(16, 4)
    _run_seq(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # Same second block content after a different first block: no hit at all.
    assert bm.find_cached_prefix("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == []
    # Same first block, different second: only the first hits.
    assert bm.find_cached_prefix("c", [1, 2, 3, 4, 5, 6, 7, 0, 0]) == bm.tables["a"][:1]
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(hash_block(None, [9, 9, 9, 9]), [1, 2, 3, 4])


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_find_cached_prefix_leaves_the_last_token_to_compute(block_size):
    bm = BlockManager(32, block_size)
    prompt = list(range(4 * block_size))  # an exact multiple of block_size
    _run_seq(bm, "a", prompt)
    hits = bm.find_cached_prefix("b", prompt)
    assert len(hits) == len(prompt) // block_size - 1
    assert len(hits) * block_size == len(prompt) - block_size < len(prompt)
    assert bm.find_cached_prefix("c", prompt[:1]) == []


def test_prefix_caching_disabled_finds_nothing():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    _run_seq(bm, "a", list(range(12)))
    assert bm.find_cached_prefix("b", list(range(12))) == [] and bm.pool.cached == {}


def test_eviction_removes_the_hash_from_the_cache():
    bm = BlockManager(4, 2)
    prompt = [1, 2, 3, 4, 5]
    _run_seq(bm, "a", prompt)  # 3 blocks; the two full ones are cached
    first, second = bm.tables["a"][0], bm.tables["a"][1]
    h0, h1 = first.block_hash, second.block_hash
    assert h0 is not None and h1 is not None
    bm.free("a")
    assert bm.pool.num_cached_free == 2
    # Free queue: the uncached partial block and the never-used block first, then the tail of the
    # prefix (freed first), then its head.
    assert bm.allocate_slots("b", 0, 6) is not None  # 3 blocks: the two uncached + the suffix block
    assert h1 not in bm.pool.cached and h0 in bm.pool.cached and second.block_hash is None
    assert bm.pool.num_evictions == 1
    assert bm.find_cached_prefix("c", prompt) == [first]
    assert bm.allocate_slots("d", 0, 2) is not None  # evicts the head too
    assert bm.pool.cached == {} and bm.find_cached_prefix("e", prompt) == []


def test_cached_prefix_in_the_free_queue_counts_against_capacity():
    bm = BlockManager(3, 2)
    _run_seq(bm, "a", [1, 2, 3, 4, 5])  # 3 blocks, all in use
    bm.free("a")
    hits = bm.find_cached_prefix("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(hits) == 2
    before = snapshot(bm)
    # 8 tokens = 4 blocks > 3 in the pool: refused, and nothing changed (hits not touched).
    assert bm.allocate_slots("b", 4, 4, hits) is None
    assert snapshot(bm) == before
    assert bm.allocate_slots("b", 4, 2, hits) is not None
    assert bm.num_free_blocks == 0


# ---- BlockManager: fork and copy-on-write -------------------------------------------------------

def test_fork_shares_blocks_and_copy_on_write_only_for_the_partial_block():
    bm = BlockManager(16, 4)
    _run_seq(bm, "p", list(range(10)))  # blocks: full, full, partial (2 tokens)
    bm.fork("p", "c")
    assert [b.ref_count for b in bm.tables["p"]] == [2, 2, 2]
    new, copy = bm.allocate_slots("c", 10, 1)
    assert new == [] and copy is not None
    assert copy[0] == bm.tables["p"][2].block_id and copy[1] == bm.tables["c"][2].block_id
    assert [b.ref_count for b in bm.tables["p"]] == [2, 2, 1]
    # The parent's own next write lands in a block it now holds alone: no copy.
    assert bm.allocate_slots("p", 10, 1) == ([], None)
    # Filling the block and spilling into a new one: a new block, no copy.
    new, copy = bm.allocate_slots("c", 11, 2)
    assert len(new) == 1 and copy is None


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(16, 4)
    _run_seq(bm, "p", list(range(8)))
    bm.fork("p", "c")
    new, copy = bm.allocate_slots("c", 8, 1)
    assert len(new) == 1 and copy is None
    assert bm.tables["c"][:2] == bm.tables["p"]


def test_copy_on_write_refused_when_the_pool_is_full():
    bm = BlockManager(3, 4)
    _run_seq(bm, "p", list(range(10)))
    bm.fork("p", "c")
    before = snapshot(bm)
    assert bm.allocate_slots("c", 10, 1) is None  # the copy needs a block and none is free
    assert snapshot(bm) == before


# ---- BlockManager: swapping ---------------------------------------------------------------------

def test_swap_out_and_in_round_trip():
    bm = BlockManager(8, 2, num_cpu_blocks=4)
    _run_seq(bm, "a", [1, 2, 3, 4, 5])
    old = bm.block_ids("a")
    out = bm.swap_out("a")
    assert [d for d, _ in out] == old and "a" not in bm.tables
    assert bm.num_free_blocks == 8 and bm.cpu_pool.num_free == 1
    assert bm.can_swap_in("a")
    back = bm.swap_in("a")
    assert [h for h, _ in back] == [h for _, h in out] and bm.block_ids("a") == [d for _, d in back]
    assert bm.cpu_pool.num_free == 4 and bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_swap_out_needs_room_on_the_host():
    bm = BlockManager(8, 2, num_cpu_blocks=2)
    _run_seq(bm, "a", [1, 2, 3, 4, 5])
    assert not bm.can_swap_out("a")
    assert not BlockManager(8, 2).can_swap_out("a")
    bm.free("a")
    _run_seq(bm, "b", [1, 2, 3])
    bm.swap_out("b")
    bm.free("b")  # freeing a swapped sequence releases its host blocks
    assert bm.cpu_pool.num_free == 2 and not bm.cpu_tables


# ---- regressions ---------------------------------------------------------------------------------

def test_partially_computed_block_is_not_cached_after_a_prefill_chunk():
    bm = BlockManager(8, 4)
    prompt = list(range(12))
    assert bm.find_cached_prefix("a", prompt) == []
    assert bm.allocate_slots("a", 0, 6) is not None  # first chunk: positions 0..5
    bm.cache_full_blocks("a", prompt, 6)  # only block 0 is fully computed
    assert bm.tables["a"][1].block_hash is None, "block 1 (positions 4..7) holds only 4, 5"
    assert len(bm.find_cached_prefix("b", prompt)) <= 1
