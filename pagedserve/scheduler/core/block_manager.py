"""Per-sequence block tables over the device pool (and a host pool for swapping).

Prefix caching: a full block is named by a hash chained over its parent's hash and its token ids,
so equal prefixes map to equal hashes and a new sequence can reuse the blocks of an old one.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.core.block_pool import BlockPool, KVBlock


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    # Tuples of ints hash deterministically (no PYTHONHASHSEED salt), so hashes are stable
    # across processes; the parent link makes a block's hash name its whole prefix.
    return hash((parent_hash, tuple(token_ids)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, watermark: float = 0.01) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks else None
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[str, list[KVBlock]] = {}
        self.cpu_tables: dict[str, list[KVBlock]] = {}
        self.block_hashes: dict[str, list[int]] = {}  # chained hashes of the sequence's full blocks
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already entered in the cache
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(self.tables.get(seq_id, ())))

    # ---- prefix cache --------------------------------------------------------------------
    def _extend_hashes(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        hashes = self.block_hashes.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int]) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of token_ids, leaving at least one
        token to compute (its logits are needed). Takes no references."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._extend_hashes(seq_id, token_ids, max_blocks * self.block_size)
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Enter the sequence's blocks whose KV is now fully written into the prefix cache."""
        if not self.enable_prefix_caching or seq_id not in self.tables:
            return
        table = self.tables[seq_id]
        hashes = self._extend_hashes(seq_id, token_ids, num_computed_tokens)
        start = self.num_cached_blocks.get(seq_id, 0)
        # Hashes may run ahead (a prefix lookup names the whole prompt): only blocks whose KV
        # is fully written may be found by others.
        end = min(num_computed_tokens // self.block_size, len(hashes), len(table))
        for i in range(start, end):
            self.pool.cache(table[i], hashes[i])
        self.num_cached_blocks[seq_id] = max(start, end)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, num_blocks: int, reserve_watermark: bool = False) -> bool:
        spare = self.watermark_blocks if reserve_watermark else 0
        return num_blocks + spare <= self.pool.num_free

    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int,
                       cached_prefix: Sequence[KVBlock] = (), reserve_watermark: bool = False
                       ) -> tuple[list[int], tuple[int, int] | None] | None:
        """Make the sequence's table hold num_computed_tokens + num_new_tokens tokens.

        Returns (new block ids, copy) where copy is a (src, dst) block copy when the block about
        to be written was shared by a fork (copy-on-write); None when the pool cannot supply the
        blocks, in which case nothing changed.
        """
        num_tokens = num_computed_tokens + num_new_tokens
        table = self.tables.get(seq_id)
        if table is None:
            # Cached blocks with no other user sit in the free queue: taking them costs capacity.
            num_free_hits = sum(1 for b in cached_prefix if b.ref_count == 0)
            need = cdiv(num_tokens, self.block_size) - len(cached_prefix) + num_free_hits
            if not self.can_allocate(need, reserve_watermark):
                return None
            for block in cached_prefix:
                self.pool.touch(block)
            table = self.tables[seq_id] = list(cached_prefix)
            self.num_cached_blocks[seq_id] = len(cached_prefix)
            table.extend(self.pool.allocate() for _ in range(cdiv(num_tokens, self.block_size) - len(table)))
            return [b.block_id for b in table], None

        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(table))
        write_index = num_computed_tokens // self.block_size
        shared = num_new_tokens > 0 and write_index < len(table) and table[write_index].ref_count > 1
        if not self.can_allocate(num_new_blocks + int(shared), reserve_watermark):
            return None
        copy = None
        if shared:
            old = table[write_index]
            fresh = self.pool.allocate()
            self.pool.free(old)
            table[write_index] = fresh
            copy = (old.block_id, fresh.block_id)
        new = [self.pool.allocate() for _ in range(num_new_blocks)]
        table.extend(new)
        return [b.block_id for b in new], copy

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (copy-on-write on the next write)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = self.tables[parent_id]
        for block in table:
            self.pool.touch(block)
        self.tables[child_id] = list(table)
        self.block_hashes[child_id] = list(self.block_hashes.get(parent_id, ()))
        self.num_cached_blocks[child_id] = self.num_cached_blocks.get(parent_id, 0)

    def free(self, seq_id: str) -> None:
        # Free the tail first so that, among equally old entries, a prefix outlives its suffix.
        for block in reversed(self.tables.pop(seq_id, ())):
            self.pool.free(block)
        for block in self.cpu_tables.pop(seq_id, ()):
            self.cpu_pool.free(block)
        self.block_hashes.pop(seq_id, None)
        self.num_cached_blocks.pop(seq_id, None)

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, seq_id: str) -> bool:
        return self.cpu_pool is not None and len(self.tables.get(seq_id, ())) <= self.cpu_pool.num_free

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        table = self.tables.pop(seq_id)
        cpu_table = [self.cpu_pool.allocate() for _ in table]
        mapping = [(g.block_id, c.block_id) for g, c in zip(table, cpu_table)]
        for block in reversed(table):
            self.pool.free(block)
        self.cpu_tables[seq_id] = cpu_table
        return mapping

    def can_swap_in(self, seq_id: str, extra_blocks: int = 0) -> bool:
        return self.can_allocate(len(self.cpu_tables[seq_id]) + extra_blocks, reserve_watermark=True)

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        cpu_table = self.cpu_tables.pop(seq_id)
        table = [self.pool.allocate() for _ in cpu_table]
        mapping = [(c.block_id, g.block_id) for c, g in zip(cpu_table, table)]
        for block in cpu_table:
            self.cpu_pool.free(block)
        self.tables[seq_id] = table
        # Same content under new ids: the next cache_full_blocks enters the written ones again.
        self.num_cached_blocks[seq_id] = 0
        return mapping
