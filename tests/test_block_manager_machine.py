"""Block pool and block manager as a hypothesis state machine: reference counts, the free queue,
prefix caching, copy-on-write, swapping, under random sequences of calls. The unit tests:
tests/test_block_pool.py and tests/test_block_manager.py.

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

from block_checks import check_cache_index, check_pool, snapshot
from pagedserve.scheduler.core.block_manager import BlockManager, cdiv, hash_block

VOCAB = st.integers(0, 3)  # a tiny vocabulary so equal prefixes (prefix-cache hits) are common


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
