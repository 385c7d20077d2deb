"""Per-sequence block tables over the device pool (and a host pool for swapping), one table per
KV group (common/model_config.KVGroups).

Prefix caching: a full block is named by a hash chained over its parent's hash and its token ids,
the first block's over the request's cache salt (common/prefix_hashes.py: sha256, the owner in the
salt), so equal prefixes of one owner map to equal hashes and a new sequence can reuse the blocks
of an old one; another owner's equal prefix is another name.

KV groups (after vLLM v1's KVCacheCoordinator): a model with sliding-window layers has several
groups over ONE pool (one id space, one free queue, one prefix cache whose keys carry the group).
Group 0 is a full-attention group and is what `tables` / `cpu_tables` / `block_ids` show: a model
without sliding layers has only it, and behaves exactly as a single-table manager. A sliding
group (window W) replaces every block that lies wholly before `num_computed_tokens - W + 1` by
the null block (id 0, held for ever, never written; attention masks or skips it) and frees it
(vLLM's remove_skipped_blocks), so it holds about W / block_size + 1 blocks however long the
sequence. Invariant: every group's table has the same length (null entries included), so block
index i names tokens i*bs .. (i+1)*bs - 1 in every group. Single-threaded (the step loop's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve.common.prefix_hashes import hash_block
from pagedserve.scheduler.core.block_pool import BlockPool, KVBlock

__all__ = ["Allocation", "BlockManager", "hash_block"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Allocation:
    """What allocate() changed: per group the block ids appended to its table (the whole table for
    a new sequence), and the copy-on-write replacements as (group, index, src, dst)."""
    new_block_ids: list[list[int]]
    replaced: list[tuple[int, int, int, int]]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, watermark: float = 0.01, windows: Sequence[int] = (0,)) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.windows = tuple(windows) or (0,)
        if self.windows[0]:
            raise ValueError("KV group 0 must be a full-attention group (window 0)")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # Stands for every block a sliding group dropped: block 0, allocated once and never freed.
        self.null_block = self.pool.allocate() if any(self.windows) else None
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks else None
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.group_tables: list[dict[str, list[KVBlock]]] = [{} for _ in self.windows]
        self.group_cpu_tables: list[dict[str, list[KVBlock | None]]] = [{} for _ in self.windows]
        self.tables = self.group_tables[0]
        self.cpu_tables = self.group_cpu_tables[0]
        self.block_hashes: dict[str, list[int]] = {}  # chained hashes of the sequence's full blocks
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already entered in the cache
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can hold KV (the null block excluded)."""
        return self.pool.num_blocks - (self.null_block is not None)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_total_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def group_block_ids(self, seq_id: str) -> list[list[int]]:
        """The tables of groups 1.. (empty for a single-group model)."""
        return [[b.block_id for b in tables.get(seq_id, ())] for tables in self.group_tables[1:]]

    def num_held_blocks(self, seq_id: str) -> int:
        """Real blocks the sequence holds on the device, over all groups (null entries excluded)."""
        return sum(b is not self.null_block for tables in self.group_tables for b in tables.get(seq_id, ()))

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(self.tables.get(seq_id, ()))) * self.num_groups

    # ---- prefix cache --------------------------------------------------------------------
    def _key(self, group: int, block_hash: int) -> int:
        # The same tokens in another group are other layers' KV: another cache entry (hashes are
        # 128-bit: the group above them keeps the names distinct).
        return block_hash if group == 0 else (group << 128) | block_hash

    def _extend_hashes(self, seq_id: str, token_ids: Sequence[int], num_tokens: int, salt: str = "",
                       extras: Mapping[int, bytes] | None = None) -> list[int]:
        hashes = self.block_hashes.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], salt,
                                     extras.get(i, b"") if extras else b""))
        return hashes

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int], salt: str = "",
                           extras: Mapping[int, bytes] | None = None) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of token_ids, leaving at least one
        token to compute (its logits are needed), that every group can serve (a sliding group
        needs only the blocks inside the window of the first token to compute). Returns group 0's
        blocks; allocate() looks the other groups' up again. Takes no references."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._extend_hashes(seq_id, token_ids, max_blocks * self.block_size, salt, extras)
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        num = len(hits)
        while num and self.num_groups > 1:  # a sliding group's hit may shrink as the point moves left
            shortest = min(self._group_hit(g, hashes, num) for g in range(1, self.num_groups))
            if shortest == num:
                break
            num = shortest
        return hits[:num]

    def _group_hit(self, group: int, hashes: list[int], num: int) -> int:
        """The most blocks <= num of a cached prefix that `group` can serve."""
        lookup, window = self.pool.lookup, self.windows[group]
        if not window:
            i = 0
            while i < num and lookup(self._key(group, hashes[i])) is not None:
                i += 1
            return i
        need = cdiv(window - 1, self.block_size)  # blocks before the hit point that its window reaches
        if need == 0:
            return num
        run = 0
        for i in range(num - 1, -1, -1):  # right to left (vLLM's SlidingWindowManager)
            if lookup(self._key(group, hashes[i])) is None:
                run = 0
                continue
            run += 1
            if run == need:
                return i + need
        return run  # blocks 0 .. run - 1: the window of the hit point reaches back to block 0

    def _skipped(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks of a group's table that no query from num_computed_tokens on sees."""
        window = self.windows[group]
        return max(0, num_computed_tokens - window + 1) // self.block_size if window else 0

    def _group_prefix(self, seq_id: str, group: int, num: int, hits: Sequence[KVBlock]) -> list[KVBlock]:
        if group == 0 or num == 0:
            return list(hits)
        hashes = self.block_hashes[seq_id]
        skip = min(num, self._skipped(group, num * self.block_size))
        return [self.null_block] * skip + [self.pool.lookup(self._key(group, h)) for h in hashes[skip:num]]

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          salt: str = "", extras: Mapping[int, bytes] | None = None) -> None:
        """Enter the sequence's blocks whose KV is now fully written into the prefix cache (salt,
        extras: the request's cache salt and image hashes, as given to find_cached_prefix)."""
        if not self.enable_prefix_caching or seq_id not in self.tables:
            return
        start = self.num_cached_blocks.get(seq_id, 0)
        if num_computed_tokens // self.block_size <= start:
            return  # no block filled since the last call (most decode steps): nothing to hash or enter
        hashes = self._extend_hashes(seq_id, token_ids, num_computed_tokens, salt, extras)
        # Hashes may run ahead (a prefix lookup names the whole prompt): only blocks whose KV
        # is fully written may be found by others.
        end = min(num_computed_tokens // self.block_size, len(hashes), len(self.tables[seq_id]))
        for group, tables in enumerate(self.group_tables):
            table = tables[seq_id]
            for i in range(start, end):
                if table[i] is not self.null_block:
                    self.pool.cache(table[i], self._key(group, hashes[i]))
        self.num_cached_blocks[seq_id] = max(start, end)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, num_blocks: int, reserve_watermark: bool = False) -> bool:
        spare = self.watermark_blocks if reserve_watermark else 0
        return num_blocks + spare <= self.pool.num_free

    def remove_skipped_blocks(self, seq_id: str, num_computed_tokens: int) -> None:
        """Sliding groups: free the blocks wholly out of the window of the next token to compute."""
        for group in range(1, self.num_groups):
            table = self.group_tables[group].get(seq_id)
            if table is None or not self.windows[group]:
                continue
            for i in range(min(len(table), self._skipped(group, num_computed_tokens)) - 1, -1, -1):
                if table[i] is self.null_block:
                    break  # everything before is null already
                self.pool.free(table[i])
                table[i] = self.null_block

    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int,
                       cached_prefix: Sequence[KVBlock] = (), reserve_watermark: bool = False
                       ) -> tuple[list[int], tuple[int, int] | None] | None:
        """allocate(), seen through group 0: (its new block ids, its copy-on-write (src, dst))."""
        result = self.allocate(seq_id, num_computed_tokens, num_new_tokens, cached_prefix, reserve_watermark)
        if result is None:
            return None
        copy = next(((src, dst) for group, _, src, dst in result.replaced if group == 0), None)
        return result.new_block_ids[0], copy

    def allocate(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int,
                 cached_prefix: Sequence[KVBlock] = (), reserve_watermark: bool = False) -> Allocation | None:
        """Make the sequence's tables hold num_computed_tokens + num_new_tokens tokens.

        A block about to be written that a fork shares is replaced by a copy (copy-on-write).
        None when the pool cannot supply the blocks; then nothing changed but the release of
        blocks already out of a sliding window.
        """
        num_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        table = self.tables.get(seq_id)
        if table is not None and self.num_groups == 1 and not reserve_watermark and num_blocks <= len(table):
            # The usual decode row: its blocks suffice, and the one it writes is its own (what the general
            # path below finds, without its per-group bookkeeping; it runs on every row of every step).
            write_index = num_computed_tokens // self.block_size
            if not (num_new_tokens > 0 and write_index < len(table) and table[write_index].ref_count > 1
                    and table[write_index] is not self.null_block):
                return Allocation([[]], [])
        if table is None:
            num = len(cached_prefix)
            prefixes = [self._group_prefix(seq_id, g, num, cached_prefix) for g in range(self.num_groups)]
            # Cached blocks with no other user sit in the free queue: taking them costs capacity.
            need = sum(max(0, num_blocks - num) + sum(1 for b in p if b.ref_count == 0) for p in prefixes)
            if not self.can_allocate(need, reserve_watermark):
                return None
            # Take every group's hits before allocating: a hit may sit in the free queue.
            for prefix in prefixes:
                for block in prefix:
                    if block is not self.null_block:
                        self.pool.touch(block)
            new_ids = []
            for tables, prefix in zip(self.group_tables, prefixes):
                table = tables[seq_id] = prefix
                table.extend(self.pool.allocate() for _ in range(num_blocks - len(table)))
                new_ids.append([b.block_id for b in table])
            self.num_cached_blocks[seq_id] = num
            return Allocation(new_ids, [])

        self.remove_skipped_blocks(seq_id, num_computed_tokens)
        write_index = num_computed_tokens // self.block_size
        need, shared = 0, []
        for tables in self.group_tables:
            table = tables[seq_id]
            need += max(0, num_blocks - len(table))
            shared.append(num_new_tokens > 0 and write_index < len(table) and table[write_index].ref_count > 1
                          and table[write_index] is not self.null_block)
        if not self.can_allocate(need + sum(shared), reserve_watermark):
            return None
        new_ids, replaced = [], []
        for group, tables in enumerate(self.group_tables):
            table = tables[seq_id]
            if shared[group]:
                old = table[write_index]
                fresh = self.pool.allocate()
                self.pool.free(old)
                table[write_index] = fresh
                replaced.append((group, write_index, old.block_id, fresh.block_id))
            new = [self.pool.allocate() for _ in range(max(0, num_blocks - len(table)))]
            table.extend(new)
            new_ids.append([b.block_id for b in new])
        return Allocation(new_ids, replaced)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (copy-on-write on the next write)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        for tables in self.group_tables:
            table = tables[parent_id]
            for block in table:
                if block is not self.null_block:
                    self.pool.touch(block)
            tables[child_id] = list(table)
        self.block_hashes[child_id] = list(self.block_hashes.get(parent_id, ()))
        self.num_cached_blocks[child_id] = self.num_cached_blocks.get(parent_id, 0)

    def free(self, seq_id: str) -> None:
        # Free the tail first so that, among equally old entries, a prefix outlives its suffix.
        for tables, cpu_tables in zip(self.group_tables, self.group_cpu_tables):
            for block in reversed(tables.pop(seq_id, ())):
                if block is not self.null_block:
                    self.pool.free(block)
            for block in cpu_tables.pop(seq_id, ()):
                if block is not None:
                    self.cpu_pool.free(block)
        self.block_hashes.pop(seq_id, None)
        self.num_cached_blocks.pop(seq_id, None)

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, seq_id: str) -> bool:
        return self.cpu_pool is not None and self.num_held_blocks(seq_id) <= self.cpu_pool.num_free

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        """Every group's real blocks to the host pool; null entries stay null (None there)."""
        mapping = []
        for tables, cpu_tables in zip(self.group_tables, self.group_cpu_tables):
            table = tables.pop(seq_id)
            cpu_table = [None if b is self.null_block else self.cpu_pool.allocate() for b in table]
            mapping += [(g.block_id, c.block_id) for g, c in zip(table, cpu_table) if c is not None]
            for block in reversed(table):
                if block is not self.null_block:
                    self.pool.free(block)
            cpu_tables[seq_id] = cpu_table
        return mapping

    def can_swap_in(self, seq_id: str, extra_blocks: int = 0) -> bool:
        """extra_blocks: new blocks per group the sequence's next chunk needs."""
        held = sum(b is not None for cpu_tables in self.group_cpu_tables for b in cpu_tables[seq_id])
        return self.can_allocate(held + extra_blocks * self.num_groups, reserve_watermark=True)

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        mapping = []
        for tables, cpu_tables in zip(self.group_tables, self.group_cpu_tables):
            cpu_table = cpu_tables.pop(seq_id)
            table = [self.null_block if c is None else self.pool.allocate() for c in cpu_table]
            mapping += [(c.block_id, g.block_id) for c, g in zip(cpu_table, table) if c is not None]
            for block in cpu_table:
                if block is not None:
                    self.cpu_pool.free(block)
            tables[seq_id] = table
        # Same content under new ids: the next cache_full_blocks enters the written ones again.
        self.num_cached_blocks[seq_id] = 0
        return mapping
