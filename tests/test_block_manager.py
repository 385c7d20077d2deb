"""Block pool and block manager: reference counts, the free queue, prefix caching, copy-on-write,
swapping.

The state machine keeps its own model of every sequence (its tokens, how many are computed) and of
what each device/host block holds (token ids written slot by slot), and checks after every step
that the manager's bookkeeping agrees with it: reference counts, the free queue, the prefix-cache
index, nothing leaked, and that every computed token of every sequence can still be read back from
the blocks its table names (so a shared block is never overwritten and a prefix-cache hit really
holds the prefix it is named after).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.scheduler.core.block_manager import BlockManager, cdiv, hash_block
from pagedserve.scheduler.core.block_pool import BlockPool, FreeBlockQueue, KVBlock

VOCAB = st.integers(0, 3)  # a tiny vocabulary so equal prefixes (prefix-cache hits) are common


# ---- helpers -------------------------------------------------------------------------------------

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


# ---- the state machine ---------------------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Model: seqs[seq_id] = [tokens, num_computed] for sequences on the device, swapped[seq_id] for
    those on the host; content[block_id][offset] = the token written there (device), host likewise.
    prefix_of[hash] = the whole token prefix a chained block hash names."""

    @initialize(num_blocks=st.integers(8, 32), block_size=st.integers(1, 4),
                num_cpu_blocks=st.sampled_from([0, 6, 24, 24]), caching=st.booleans(),
                auto_cache=st.booleans())
    def setup(self, num_blocks, block_size, num_cpu_blocks, caching, auto_cache):
        self.auto_cache = auto_cache  # cache_full_blocks after every write, as the scheduler does
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching,
                               num_cpu_blocks=num_cpu_blocks, watermark=0.0)
        self.bs = block_size
        self.seqs: dict[str, list] = {}
        self.swapped: dict[str, list] = {}
        self.gone: list[str] = []  # freed sequence ids
        self.content: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.host: dict[int, list] = {i: [None] * block_size for i in range(num_cpu_blocks)}
        self.prefix_of: dict[int, tuple[int, ...]] = {}
        self.history: list[list[int]] = [[]]
        self.ids = itertools.count()

    # ---- model helpers ----------------------------------------------------------------------
    def _register_hashes(self, tokens):
        parent = None
        for i in range(len(tokens) // self.bs):
            parent = hash_block(parent, tokens[i * self.bs:(i + 1) * self.bs])
            prefix = tuple(tokens[:(i + 1) * self.bs])
            assert self.prefix_of.setdefault(parent, prefix) == prefix, "two prefixes share one block hash"

    def _holders(self, block_id):
        return [s for s, t in self.bm.tables.items() if any(b.block_id == block_id for b in t)]

    def _write(self, seq_id, start, stop):
        tokens, _ = self.seqs[seq_id]
        table = self.bm.tables[seq_id]
        for pos in range(start, stop):
            block = table[pos // self.bs]
            # A write never lands in a block that another table reads or that the prefix cache names.
            assert block.ref_count == 1 and self._holders(block.block_id) == [seq_id], (
                f"{seq_id} writes position {pos} into block {block.block_id} shared with "
                f"{self._holders(block.block_id)}")
            assert block.block_hash is None, f"{seq_id} overwrites prefix-cached block {block.block_id}"
            self.content[block.block_id][pos % self.bs] = tokens[pos]
        self.seqs[seq_id][1] = stop
        if self.auto_cache:
            self._cache(seq_id)

    def _need_new(self, num_tokens, hits):
        return cdiv(num_tokens, self.bs) - len(hits) + sum(1 for b in hits if b.ref_count == 0)

    def _new_id(self):
        return f"s{next(self.ids)}"

    # ---- rules --------------------------------------------------------------------------------
    @rule(data=st.data())
    def add_sequence(self, data):
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)))
        tokens = base[:cut] + data.draw(st.lists(VOCAB, min_size=0 if cut else 1, max_size=12))
        if not tokens:
            tokens = [0]
        use_prefix = data.draw(st.sampled_from([True, True, False]))
        seq_id = self._new_id()
        self._register_hashes(tokens)
        hits = []
        if use_prefix:
            refs = [b.ref_count for b in self.bm.pool.blocks]
            hits = self.bm.find_cached_prefix(seq_id, tokens)
            assert [b.ref_count for b in self.bm.pool.blocks] == refs, "find_cached_prefix took references"
            assert len(hits) * self.bs < len(tokens), "the last prompt token must be left to compute"
            if not self.bm.enable_prefix_caching:
                assert hits == []
            for i, block in enumerate(hits):
                # The hit holds exactly this prefix's block, and names the whole prefix before it.
                assert self.content[block.block_id] == tokens[i * self.bs:(i + 1) * self.bs]
                assert self.prefix_of[block.block_hash] == tuple(tokens[:(i + 1) * self.bs])
            # Longest hit: the next full block (if it could be used) is not in the cache.
            i = len(hits)
            if self.bm.enable_prefix_caching and (i + 1) * self.bs <= len(tokens) - 1:
                names = {self.prefix_of.get(b.block_hash) for b in self.bm.pool.cached.values()}
                assert tuple(tokens[:(i + 1) * self.bs]) not in names
            # A first chunk after the hits, possibly ending inside a block.
            num_new = data.draw(st.integers(1, len(tokens) - len(hits) * self.bs))
        else:
            num_new = data.draw(st.integers(1, len(tokens)))  # a first prefill chunk
        computed = len(hits) * self.bs
        need = self._need_new(computed + num_new, hits)
        before = snapshot(self.bm)
        result = self.bm.allocate_slots(seq_id, computed, num_new, hits)
        if result is None:
            assert need > self.bm.num_free_blocks, "refused although the pool had room"
            assert snapshot(self.bm) == before, "a refused allocation changed state"
            self.bm.free(seq_id)  # drop the hashes find_cached_prefix computed
            return
        assert need <= len(before[0][1]), "allocated more blocks than were free"
        new_ids, copy = result
        assert copy is None
        assert new_ids == self.bm.block_ids(seq_id)
        assert new_ids[:len(hits)] == [b.block_id for b in hits]
        self.seqs[seq_id] = [tokens, computed]
        self.history.append(tokens)
        self._write(seq_id, computed, computed + num_new)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append_tokens(self, data):
        self._append(data.draw(st.sampled_from(sorted(self.seqs))), data)

    def _append(self, seq_id, data):
        """Grow a sequence by k tokens: the rest of its prefill, or k newly generated tokens."""
        tokens, computed = self.seqs[seq_id]
        k = data.draw(st.integers(1, 6))
        extra = []
        if computed < len(tokens):
            k = min(k, len(tokens) - computed)
        else:
            extra = data.draw(st.lists(VOCAB, min_size=k, max_size=k))
        table = self.bm.tables[seq_id]
        write_index = computed // self.bs
        shared = write_index < len(table) and len(self._holders(table[write_index].block_id)) > 1
        need = max(0, cdiv(computed + k, self.bs) - len(table)) + int(shared)
        old_ids = [b.block_id for b in table]
        before = snapshot(self.bm)
        result = self.bm.allocate_slots(seq_id, computed, k)
        if result is None:
            assert need > self.bm.num_free_blocks, "refused although the pool had room"
            assert snapshot(self.bm) == before, "a refused allocation changed state"
            return
        new_ids, copy = result
        ids = self.bm.block_ids(seq_id)
        assert len(ids) == cdiv(computed + k, self.bs)
        assert ids[len(old_ids):] == new_ids
        if shared:
            # Copy-on-write: the block about to be written was shared; the sequence gets a copy.
            assert copy is not None and copy[0] == old_ids[write_index] and copy[1] == ids[write_index]
            assert copy[1] not in old_ids and copy[1] not in new_ids
            assert ids[:write_index] == old_ids[:write_index]
            self.content[copy[1]] = list(self.content[copy[0]])
        else:
            assert copy is None, f"copy {copy} although block {write_index} was not shared"
            assert ids[:len(old_ids)] == old_ids
        tokens.extend(extra)
        self._write(seq_id, computed, computed + k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def cache_full_blocks(self, data):
        self._cache(data.draw(st.sampled_from(sorted(self.seqs))))

    def _cache(self, seq_id):
        tokens, computed = self.seqs[seq_id]
        self._register_hashes(tokens[:computed])
        self.bm.cache_full_blocks(seq_id, tokens, computed)
        if self.bm.enable_prefix_caching:
            # Every full computed block is now findable (by this block or an equal one).
            for i, block in enumerate(self.bm.tables[seq_id][:computed // self.bs]):
                prefix = tuple(tokens[:(i + 1) * self.bs])
                assert block.block_hash is None or self.prefix_of[block.block_hash] == prefix
        else:
            assert not self.bm.pool.cached

    @precondition(lambda self: len(self.seqs) < 8 and any(c == len(t) for t, c in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data)

    def _fork(self, data):
        parent = data.draw(st.sampled_from(sorted(s for s, (t, c) in self.seqs.items() if c == len(t))))
        child = self._new_id()
        self.bm.fork(parent, child)
        assert self.bm.block_ids(child) == self.bm.block_ids(parent)
        tokens, computed = self.seqs[parent]
        self.seqs[child] = [list(tokens), computed]
        with pytest.raises(ValueError):
            self.bm.fork(parent, child)
        return parent, child

    @precondition(lambda self: len(self.seqs) < 8 and any(c == len(t) for t, c in self.seqs.values()))
    @rule(data=st.data())
    def fork_then_write(self, data):
        """The common case: a fork, then one of the two writes its next token(s)."""
        pair = self._fork(data)
        self._append(data.draw(st.sampled_from(pair)), data)

    @precondition(lambda self: self.seqs or self.swapped)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs) + sorted(self.swapped)))
        self.bm.free(seq_id)
        self.seqs.pop(seq_id, None)
        self.swapped.pop(seq_id, None)
        self.gone.append(seq_id)
        assert seq_id not in self.bm.tables and seq_id not in self.bm.cpu_tables
        assert seq_id not in self.bm.block_hashes and seq_id not in self.bm.num_cached_blocks
        before = snapshot(self.bm)
        self.bm.free(seq_id)  # a second free is a no-op
        assert snapshot(self.bm) == before

    @precondition(lambda self: len(self.seqs) + len(self.swapped) > 3)
    @rule(data=st.data())
    def free_more(self, data):
        self.free(data)

    @rule()
    def free_unknown_is_noop(self):
        before = snapshot(self.bm)
        self.bm.free("never-seen")
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.bm.num_free_blocks > 0)
    @rule(data=st.data())
    def pool_free_of_free_block_raises(self, data):
        block_id = data.draw(st.sampled_from(self.bm.pool.free_queue.block_ids()))
        before = snapshot(self.bm)
        with pytest.raises(ValueError, match="freed twice"):
            self.bm.pool.free(self.bm.pool.blocks[block_id])
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.seqs and self.bm.cpu_pool is not None)
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        table = self.bm.block_ids(seq_id)
        can = self.bm.can_swap_out(seq_id)
        assert can == (len(table) <= self.bm.cpu_pool.num_free)
        if not can:
            return
        mapping = self.bm.swap_out(seq_id)
        assert [d for d, _ in mapping] == table
        assert len({h for _, h in mapping}) == len(mapping)
        for dev, host in mapping:
            self.host[host] = list(self.content[dev])
        self.swapped[seq_id] = self.seqs.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        n = len(self.bm.cpu_tables[seq_id])
        can = self.bm.can_swap_in(seq_id)
        assert can == (n <= self.bm.num_free_blocks)
        if not can:
            return
        mapping = self.bm.swap_in(seq_id)
        assert [d for _, d in mapping] == self.bm.block_ids(seq_id)
        for host, dev in mapping:
            self.content[dev] = list(self.host[host])
        self.seqs[seq_id] = self.swapped.pop(seq_id)

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def ref_counts_free_queue_and_no_leaks(self):
        check_pool(self.bm.pool, self.bm.tables)
        if self.bm.cpu_pool is not None:
            check_pool(self.bm.cpu_pool, self.bm.cpu_tables)
        else:
            assert not self.bm.cpu_tables

    @invariant()
    def tables_match_the_model(self):
        assert set(self.bm.tables) == set(self.seqs)
        assert set(self.bm.cpu_tables) == set(self.swapped)
        for seq_id, (_, computed) in self.seqs.items():
            assert len(self.bm.tables[seq_id]) == cdiv(computed, self.bs)
        for seq_id, (_, computed) in self.swapped.items():
            assert len(self.bm.cpu_tables[seq_id]) == cdiv(computed, self.bs)
        for seq_id in self.gone:
            assert seq_id not in self.bm.tables and seq_id not in self.bm.cpu_tables

    @invariant()
    def prefix_cache_index(self):
        check_cache_index(self.bm.pool)
        if not self.bm.enable_prefix_caching:
            assert not self.bm.pool.cached
        for block_hash, block in self.bm.pool.cached.items():
            # A cached block is full, and holds the last block of the prefix its hash names.
            assert self.content[block.block_id] == list(self.prefix_of[block_hash][-self.bs:]), (
                f"cached block {block.block_id} holds {self.content[block.block_id]}")

    @invariant()
    def every_computed_token_reads_back(self):
        for seq_id, (tokens, computed) in self.seqs.items():
            table = self.bm.tables[seq_id]
            for pos in range(computed):
                assert self.content[table[pos // self.bs].block_id][pos % self.bs] == tokens[pos], (
                    f"{seq_id}: position {pos} was overwritten")
        for seq_id, (tokens, computed) in self.swapped.items():
            table = self.bm.cpu_tables[seq_id]
            for pos in range(computed):
                assert self.host[table[pos // self.bs].block_id][pos % self.bs] == tokens[pos]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


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
