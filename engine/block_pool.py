"""A pool of physical KV blocks: free queue, reference counts, and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is requested from an exhausted pool (a scheduler bug)."""


class BlockPool:
    """Physical blocks of one device (GPU/CPU) with ref counts and hash → block caching.

    A block with ref count 0 is free. If it carries a content hash it stays findable through
    the hash until it is handed out again, so freed prefixes can be reused (least recently
    freed blocks are evicted first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # free blocks in eviction order: uncached blocks first, then cached ones by age
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable cached prefix."""
        return sum(1 for block in self._free if block in self._hash_of_block)

    def allocate(self) -> int:
        """Take the next free block (evicting its cached content), with ref count 1."""
        if not self._free:
            raise NoFreeBlocksError("no free KV blocks left")
        block, _ = self._free.popitem(last=False)
        self._forget_hash(block)
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference; a free cached block is taken back out of the free queue."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        """Drop a reference; at zero the block becomes free (kept findable if cached)."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than it was referenced")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if block not in self._hash_of_block:
                self._free.move_to_end(block, last=False)

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the content with ``block_hash``, if still cached."""
        return self._block_of_hash.get(block_hash)

    def register(self, block: int, block_hash: int) -> None:
        """Record that ``block`` holds the full, computed content identified by ``block_hash``."""
        if not self.enable_caching or block_hash in self._block_of_hash or block in self._hash_of_block:
            return
        self._hash_of_block[block] = block_hash
        self._block_of_hash[block_hash] = block

    def is_cached(self, block: int) -> bool:
        """True when ``block`` is in the prefix-cache index."""
        return block in self._hash_of_block

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]

    def check_invariants(self) -> None:
        """Assert the pool is consistent (used by tests): free ⇔ ref 0, hash maps mirror."""
        for block, refs in enumerate(self.ref_counts):
            assert refs >= 0, f"block {block} has negative ref count"
            assert (refs == 0) == (block in self._free), f"block {block}: refs={refs} vs free list"
        for block, block_hash in self._hash_of_block.items():
            assert self._block_of_hash[block_hash] == block
        assert len(self._hash_of_block) == len(self._block_of_hash)
