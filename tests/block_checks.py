"""Checks on a block manager's bookkeeping, shared by the block manager's state machine and its
unit tests: a snapshot of everything observable (to check that a refused call changed nothing),
reference counts against the tables and the free queue, and the prefix-cache index."""

from __future__ import annotations

from pagedserve.scheduler.core.block_manager import BlockManager
from pagedserve.scheduler.core.block_pool import BlockPool, KVBlock


def snapshot(bm: BlockManager):
    """Everything observable about a manager, to check that a refused call changed nothing."""
    def pool_state(pool):
        if pool is None:
            return None
        return ([(b.block_id, b.ref_count, b.block_hash) for b in pool.blocks], pool.free_queue.block_ids(),
                {h: b.block_id for h, b in pool.cached.items()}, pool.num_evictions)
    return (pool_state(bm.pool), pool_state(bm.cpu_pool),
            {s: [b.block_id for b in t] for s, t in bm.tables.items()},
            {s: [b.block_id for b in t] for s, t in bm.cpu_tables.items()},
            {s: list(h) for s, h in bm.block_hashes.items()}, dict(bm.num_cached_blocks))


def check_pool(pool: BlockPool, tables: dict[str, list[KVBlock]]) -> None:
    """ref_count == number of tables holding the block; free queue == blocks with ref_count 0."""
    counts = {b.block_id: 0 for b in pool.blocks}
    for seq_id, table in tables.items():
        ids = [b.block_id for b in table]
        assert len(ids) == len(set(ids)), f"{seq_id} holds a block twice: {ids}"
        for block in table:
            assert pool.blocks[block.block_id] is block, "a table holds a block of another pool"
            counts[block.block_id] += 1
    for block in pool.blocks:
        assert block.ref_count == counts[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, held by {counts[block.block_id]} tables")
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)), f"a block is twice in the free queue: {free_ids}"
    assert len(free_ids) == len(pool.free_queue) == pool.num_free
    assert set(free_ids) == {i for i, c in counts.items() if c == 0}, "free queue != blocks with ref_count 0"
    for block in pool.blocks:
        in_queue = block.prev_free is not None
        assert in_queue == (block.ref_count == 0)
        assert (block.prev_free is None) == (block.next_free is None)
    referenced = {i for i, c in counts.items() if c > 0}
    assert pool.num_free + len(referenced) == pool.num_blocks, "blocks leaked"


def check_cache_index(pool: BlockPool) -> None:
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
        assert pool.blocks[block.block_id] is block
    hashed = {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert hashed == {b.block_id for b in pool.cached.values()}, "a block holds a hash the index lost"
