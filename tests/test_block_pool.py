"""The block pool: the free queue (an O(1) doubly linked list), double frees, LRU eviction of cached
blocks, and touching a cached free block."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.core.block_pool import BlockPool, FreeBlockQueue, KVBlock


# ---- FreeBlockQueue -----------------------------------------------------------------------------

def test_free_queue_popleft_order_and_append_left():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[0])
    q.append(q.popleft())
    assert q.block_ids() == [1, 2, 3, 4, 0]
    assert [q.popleft().block_id for _ in range(5)] == [1, 2, 3, 4, 0]
    with pytest.raises(IndexError):
        q.popleft()
    assert len(q) == 0 and q.block_ids() == []


def test_free_queue_remove_from_middle_touches_only_neighbours():
    blocks = [KVBlock(i) for i in range(10_000)]
    q = FreeBlockQueue(blocks)
    b = blocks[5000]
    prev, nxt = b.prev_free, b.next_free
    # O(1): removal is pure relinking of the two neighbours; poison the rest of the list to prove
    # that nothing else is walked.
    saved = [(x.prev_free, x.next_free) for x in blocks]
    for x in blocks:
        if x not in (prev, b, nxt):
            x.prev_free = x.next_free = None
    q.remove(b)
    assert prev.next_free is nxt and nxt.prev_free is prev
    assert b.prev_free is None and b.next_free is None
    for x, (p, n) in zip(blocks, saved):
        if x not in (prev, b, nxt):
            x.prev_free, x.next_free = p, n
    assert len(q) == 9_999
    ids = q.block_ids()
    assert 5000 not in ids and ids[4999] == 4999 and ids[5000] == 5001
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(b)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[1])
    q.append(b)
    assert q.block_ids()[-1] == 5000


def test_free_queue_remove_head_and_tail():
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[0])
    q.remove(blocks[2])
    assert q.block_ids() == [1] and len(q) == 1
    assert q.popleft() is blocks[1]


# ---- BlockPool ----------------------------------------------------------------------------------

def test_pool_rejects_empty_and_double_free():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(b)
    assert pool.num_free == 2


def test_lru_eviction_order():
    pool = BlockPool(6)
    blocks = [pool.allocate() for _ in range(6)]
    assert [b.block_id for b in blocks] == [0, 1, 2, 3, 4, 5]
    for i in (1, 3, 5):
        pool.cache(blocks[i], 100 + i)
    # Free in the order 3, 0, 5, 1, 4, 2: cached ones (3, 5, 1) queue up oldest-first at the back,
    # uncached ones (0, 4, 2) go to the front, most recently freed first.
    for i in (3, 0, 5, 1, 4, 2):
        pool.free(blocks[i])
    assert pool.num_free == 6 and pool.num_cached_free == 3
    order = [pool.allocate().block_id for _ in range(6)]
    assert order[:3] == [2, 4, 0], "uncached free blocks must be handed out before cached ones"
    assert order[3:] == [3, 5, 1], "cached free blocks must be evicted least recently freed first"
    assert pool.cached == {} and pool.num_evictions == 3
    assert all(b.block_hash is None for b in pool.blocks)


def test_touch_takes_a_cached_block_out_of_the_free_queue():
    pool = BlockPool(3)
    a = pool.allocate()
    pool.cache(a, 7)
    pool.free(a)
    assert pool.lookup(7) is a and a.ref_count == 0 and pool.num_free == 3
    pool.touch(a)
    assert a.ref_count == 1 and pool.num_free == 2 and 0 not in pool.free_queue.block_ids()
    pool.touch(a)
    assert a.ref_count == 2 and pool.num_free == 2
    # Same content under another block is not entered twice; caching is off -> no lookups.
    b = pool.allocate()
    pool.cache(b, 7)
    assert pool.cached[7] is a and b.block_hash is None
    off = BlockPool(2, enable_caching=False)
    c = off.allocate()
    off.cache(c, 1)
    assert off.lookup(1) is None and c.block_hash is None
