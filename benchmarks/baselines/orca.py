"""Orca-style reservation: each request holds KV space for its whole (reserved) length from admission.

The engine's scheduler, model and kernels stay as they are; only the block manager changes, so
the comparison isolates paging (allocate on demand) against reservation (allocate up front).
A reservation is taken in whole blocks from the same pool under the same KV budget. Real
contiguous allocators also lose memory to external fragmentation; this emulation does not, so
it is an upper bound on Orca's throughput.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.workloads import Request
from engine.block_manager import BlockManager
from engine.sequence import Sequence
from engine.utils import cdiv

ReservePolicy = Callable[[Request, int], int]



def reserve_max(request: Request, max_seq_len: int) -> int:
    """Orca-Max: every request reserves the maximum sequence length."""
    return max_seq_len


def reserve_pow2(request: Request, max_seq_len: int) -> int:
    """Orca-Pow2: the final length rounded up to a power of two (at most 2x over-reservation)."""
    return min(max_seq_len, 1 << (request.total_len - 1).bit_length())


def reserve_oracle(request: Request, max_seq_len: int) -> int:
    """Orca-Oracle: exactly the final length (knows the output length in advance)."""
    return request.total_len


POLICIES: dict[str, ReservePolicy] = {"orca-max": reserve_max, "orca-pow2": reserve_pow2, "orca-oracle": reserve_oracle}


class ReservingBlockManager(BlockManager):
    """A block manager that allocates a sequence's whole reservation when it is admitted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reserved_tokens: dict[int, int] = {}

    def _reserved_blocks(self, seq: Sequence) -> int:
        return cdiv(max(self.reserved_tokens[seq.seq_id], seq.num_tokens), self.block_size)

    def can_allocate(self, seq: Sequence, reuse_prefix: bool = True) -> bool:
        """True when the whole reservation fits now, keeping the watermark free."""
        return self.gpu.num_free_blocks - self._reserved_blocks(seq) >= self.watermark_blocks

    def allocate(self, seq: Sequence, reuse_prefix: bool = True) -> None:
        """Allocate the prompt as usual, then the rest of the reservation."""
        super().allocate(seq, reuse_prefix)
        table = self.tables[seq.seq_id]
        table.extend(self.gpu.allocate() for _ in range(self._reserved_blocks(seq) - len(table)))


def install_reservation(engine: Any, policy: ReservePolicy, max_seq_len: int) -> Callable[[Any, str, Request], None]:
    """Swap ``engine``'s block manager for a reserving one; returns the hook to call after each add."""
    old = engine.block_manager
    if old.tables:
        raise RuntimeError("install_reservation needs an idle engine")
    manager = ReservingBlockManager(old.block_size, old.gpu.num_blocks, old.cpu.num_blocks,
                                    enable_caching=old.gpu.enable_caching)
    manager.watermark_blocks = old.watermark_blocks
    engine.block_manager = engine.scheduler.block_manager = engine.runner.block_manager = manager
    usable = manager.gpu.num_blocks - manager.watermark_blocks

    def on_add(engine: Any, request_id: str, request: Request) -> None:
        tokens = policy(request, max_seq_len)
        if cdiv(tokens, manager.block_size) > usable:
            raise ValueError(f"a reservation of {tokens} tokens exceeds the KV budget of {usable} blocks")
        for seq in engine.groups[request_id].seqs:
            manager.reserved_tokens[seq.seq_id] = tokens

    return on_add
