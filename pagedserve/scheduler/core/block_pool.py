"""The pool of KV blocks: reference counts, an O(1) free queue, and the prefix-cache index.

Pure Python: the pool only knows block ids; the tensors live on the worker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is a reusable prefix-cache entry
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None


class FreeBlockQueue:
    """Intrusive doubly linked list of blocks with ref_count 0.

    The head is evicted first. A block hit in the prefix cache is unlinked from the middle in O(1),
    which a deque cannot do.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Blocks with reference counts; freed blocks that hold a full, hashed block stay findable
    by their hash until the pool needs them again (least recently freed first)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        self._num_cached_free = 0  # kept up to date so that each step can read it in O(1)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached-but-unreferenced ones included."""
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix (O(1))."""
        return self._num_cached_free

    def block_states(self) -> str:
        """One character per block: '.' free, 'u' in use, 'c' free but holding a reusable prefix.
        O(num_blocks): for introspection, not for the step loop."""
        return "".join("u" if b.ref_count else ("c" if b.block_hash is not None else ".") for b in self.blocks)

    def allocate(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
            self._num_cached_free -= 1
        block.ref_count = 1
        return block

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block: KVBlock) -> None:
        """Take a reference on a block found in the cache (it may be sitting in the free queue)."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self._num_cached_free -= 1
        block.ref_count += 1

    def free(self, block: KVBlock) -> None:
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            # Uncached blocks hold nothing reusable: hand them out before cached ones.
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)
                self._num_cached_free += 1

    def cache(self, block: KVBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # the same content already lives in another block
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if block.ref_count == 0:
            self._num_cached_free += 1

    def reset_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._num_cached_free = 0
