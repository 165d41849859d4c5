"""Maps sequences to physical KV blocks: allocation, prefix reuse, fork/copy-on-write, swap."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.sequence import Sequence
from engine.utils import cdiv

BlockMapping = list[tuple[int, int]]



@dataclass(slots=True)
class CacheUsage:
    """A snapshot of how the device blocks are used."""

    num_used_blocks: int
    num_filled_slots: int
    num_cached_free_blocks: int


class BlockManager:
    """Owns the block table of every live sequence, over a device pool and a CPU swap pool."""

    def __init__(
        self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
        watermark: float = 0.01, enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, enable_caching)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.tables: dict[int, list[int]] = {}
        # chained content hashes of each sequence's full, computed blocks
        self.hashes: dict[int, list[int]] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---- admission ---------------------------------------------------------------
    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        hashes: list[int] = []
        parent = 0
        # the last token is always computed (its logits are needed), so its block never hits
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(seq.token_ids[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        blocks = []
        for block_hash in self._prompt_hashes(seq):
            block = self.gpu.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, seq: Sequence, reuse_prefix: bool = True) -> bool:
        """True when the whole sequence fits now, keeping the watermark free."""
        cached = self._cached_prefix(seq) if reuse_prefix else []
        taken_from_free = sum(1 for block in cached if self.gpu.ref_counts[block] == 0)
        needed = cdiv(seq.num_tokens, self.block_size) - len(cached) + taken_from_free
        return self.gpu.num_free_blocks - needed >= self.watermark_blocks

    def allocate(self, seq: Sequence, reuse_prefix: bool = True) -> None:
        """Give ``seq`` blocks for all its tokens, reusing its longest cached prefix unless told not to (a prompt
        whose logprobs are wanted is computed whole: cached blocks have K/V, not logits)."""
        cached = self._cached_prefix(seq) if reuse_prefix else []
        self.num_prefix_queries += cdiv(seq.num_tokens, self.block_size)
        self.num_prefix_hits += len(cached)
        for block in cached:
            self.gpu.incref(block)
        fresh = [self.gpu.allocate() for _ in range(cdiv(seq.num_tokens, self.block_size) - len(cached))]
        self.tables[seq.seq_id] = cached + fresh
        self.hashes[seq.seq_id] = self._prompt_hashes(seq)[: len(cached)]
        seq.num_computed_tokens = len(cached) * self.block_size

    # ---- growth --------------------------------------------------------------------
    def _blocks_to_write(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int]:
        """(new blocks to allocate, shared blocks to copy) to compute ``num_new_tokens`` more."""
        table = self.tables[seq.seq_id]
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + num_new_tokens - 1) // self.block_size
        num_new = max(0, last + 1 - len(table))
        num_cow = sum(1 for i in range(first, min(last + 1, len(table))) if self.gpu.ref_counts[table[i]] > 1)
        return num_new, num_cow

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks ``seq`` needs to compute ``num_new_tokens`` more tokens."""
        return sum(self._blocks_to_write(seq, num_new_tokens))

    @property
    def num_free_gpu_blocks(self) -> int:
        """Device blocks available for allocation (cached free blocks included)."""
        return self.gpu.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> BlockMapping:
        """Make room to write ``num_new_tokens``; returns copy-on-write ``(src, dst)`` pairs."""
        table = self.tables[seq.seq_id]
        first = seq.num_computed_tokens // self.block_size
        last = (seq.num_computed_tokens + num_new_tokens - 1) // self.block_size
        copies: BlockMapping = []
        for i in range(first, min(last + 1, len(table))):
            # a shared block is about to be written by this sequence only: give it its own copy
            if self.gpu.ref_counts[table[i]] > 1:
                new_block = self.gpu.allocate()
                copies.append((table[i], new_block))
                self.gpu.decref(table[i])
                table[i] = new_block
        while len(table) <= last:
            table.append(self.gpu.allocate())
        return copies

    def block_table(self, seq: Sequence) -> list[int]:
        """The device blocks holding ``seq``'s tokens, in order (the manager's own list: read, don't keep)."""
        return self.tables[seq.seq_id]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Index every newly full, computed block of ``seq`` by its chained content hash."""
        hashes = self.hashes[seq.seq_id]
        table = self.tables[seq.seq_id]
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        parent = hashes[-1] if hashes else 0
        for i in range(len(hashes), num_full):
            start = i * self.block_size
            parent = hash((parent, tuple(seq.token_ids[start : start + self.block_size])))
            hashes.append(parent)
            self.gpu.register(table[i], parent)

    # ---- sharing -------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write on the first write)."""
        table = list(self.tables[parent.seq_id])
        for block in table:
            self.gpu.incref(block)
        self.tables[child.seq_id] = table
        self.hashes[child.seq_id] = list(self.hashes[parent.seq_id])

    def free(self, seq: Sequence, on_cpu: bool = False) -> None:
        """Release ``seq``'s references; blocks shared with others stay."""
        pool = self.cpu if on_cpu else self.gpu
        for block in self.tables.pop(seq.seq_id, []):
            pool.decref(block)
        self.hashes.pop(seq.seq_id, None)

    # ---- swapping ------------------------------------------------------------------
    def _unique_blocks(self, seqs: list[Sequence]) -> set[int]:
        return {block for seq in seqs for block in self.tables[seq.seq_id]}

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """True when the CPU pool can hold every block of ``seqs``."""
        return len(self._unique_blocks(seqs)) <= self.cpu.num_free_blocks

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        """True when ``seqs`` fit back on the device with a slot each to grow into."""
        needed = len(self._unique_blocks(seqs)) + len(seqs)
        return self.gpu.num_free_blocks - needed >= self.watermark_blocks

    def swap_out(self, seqs: list[Sequence]) -> BlockMapping:
        """Move ``seqs``' blocks to the CPU pool; returns ``(gpu, cpu)`` pairs to copy."""
        return self._move(seqs, self.gpu, self.cpu)

    def swap_in(self, seqs: list[Sequence]) -> BlockMapping:
        """Move ``seqs``' blocks back to the device; returns ``(cpu, gpu)`` pairs to copy."""
        return self._move(seqs, self.cpu, self.gpu)

    def _move(self, seqs: list[Sequence], src: BlockPool, dst: BlockPool) -> BlockMapping:
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = self.tables[seq.seq_id]
            for i, block in enumerate(table):
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.allocate()
                src.decref(block)
                table[i] = mapping[block]
        return list(mapping.items())

    # ---- accounting ----------------------------------------------------------------
    def usage(self, seqs: list[Sequence]) -> CacheUsage:
        """Used blocks and the token slots in them that hold a token (shared blocks once)."""
        filled: dict[int, int] = {}
        for seq in seqs:
            for i, block in enumerate(self.tables.get(seq.seq_id, ())):
                tokens = min(self.block_size, seq.num_tokens - i * self.block_size)
                filled[block] = max(filled.get(block, 0), tokens)
        num_used = self.gpu.num_blocks - self.gpu.num_free_blocks
        return CacheUsage(num_used, sum(filled.values()), self.gpu.num_cached_free_blocks)
