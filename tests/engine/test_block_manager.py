"""Block manager: allocation, growth, fork and copy-on-write, swapping, freeing, invariants."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager
from engine.sequence import Sequence

BLOCK = 4


def make_seq(num_tokens: int, start: int = 0) -> Sequence:
    return Sequence(token_ids=list(range(start, start + num_tokens)), prompt_len=num_tokens)


def compute(manager: BlockManager, seq: Sequence, tokens: int) -> list[tuple[int, int]]:
    copies = manager.append_slots(seq, tokens)
    seq.num_computed_tokens += tokens
    manager.register_computed_blocks(seq)
    return copies


def test_allocate_gives_blocks_for_every_prompt_token() -> None:
    manager = BlockManager(BLOCK, 10, 4, watermark=0.0, enable_caching=False)
    seq = make_seq(9)
    manager.allocate(seq)
    assert len(manager.tables[seq.seq_id]) == 3
    assert manager.num_free_gpu_blocks == 7


def test_append_allocates_a_block_only_at_a_block_boundary() -> None:
    manager = BlockManager(BLOCK, 10, 4, watermark=0.0, enable_caching=False)
    seq = make_seq(4)
    manager.allocate(seq)
    compute(manager, seq, 4)
    seq.token_ids.append(99)
    assert manager.num_blocks_needed(seq, 1) == 1
    compute(manager, seq, 1)
    assert len(manager.tables[seq.seq_id]) == 2
    seq.token_ids.append(98)
    assert manager.num_blocks_needed(seq, 1) == 0


def test_fork_shares_blocks_until_first_write() -> None:
    manager = BlockManager(BLOCK, 10, 4, watermark=0.0, enable_caching=False)
    parent = make_seq(6)
    manager.allocate(parent)
    compute(manager, parent, 6)
    child = parent.fork()
    manager.fork(parent, child)
    assert manager.tables[child.seq_id] == manager.tables[parent.seq_id]
    assert all(manager.gpu.ref_counts[b] == 2 for b in manager.tables[parent.seq_id])
    child.token_ids.append(7)
    copies = compute(manager, child, 1)
    # only the partially filled last block is copied; the full first block stays shared
    shared_first, old_last = manager.tables[parent.seq_id]
    assert copies == [(old_last, manager.tables[child.seq_id][1])]
    assert manager.tables[child.seq_id][0] == shared_first
    assert manager.gpu.ref_counts[shared_first] == 2 and manager.gpu.ref_counts[old_last] == 1


def test_swap_out_and_in_round_trip_keeps_sharing() -> None:
    manager = BlockManager(BLOCK, 8, 8, watermark=0.0, enable_caching=False)
    parent = make_seq(5)
    manager.allocate(parent)
    compute(manager, parent, 5)
    child = parent.fork()
    manager.fork(parent, child)
    out = manager.swap_out([parent, child])
    assert len(out) == 2  # shared blocks move once
    assert manager.num_free_gpu_blocks == 8 and manager.cpu.num_free_blocks == 6
    back = manager.swap_in([parent, child])
    assert len(back) == 2 and manager.cpu.num_free_blocks == 8
    assert manager.tables[parent.seq_id] == manager.tables[child.seq_id]
    assert all(manager.gpu.ref_counts[b] == 2 for b in manager.tables[parent.seq_id])


def test_free_returns_every_block() -> None:
    manager = BlockManager(BLOCK, 8, 4, watermark=0.0, enable_caching=False)
    seqs = [make_seq(n) for n in (3, 4, 9)]
    for seq in seqs:
        manager.allocate(seq)
    child = seqs[2].fork()
    manager.fork(seqs[2], child)
    for seq in [*seqs, child]:
        manager.free(seq)
    assert manager.num_free_gpu_blocks == 8
    manager.gpu.check_invariants()


def test_cached_prefix_is_reused_by_a_later_sequence() -> None:
    manager = BlockManager(BLOCK, 10, 4, watermark=0.0, enable_caching=True)
    first = make_seq(10)
    manager.allocate(first)
    compute(manager, first, 10)
    manager.free(first)
    second = Sequence(token_ids=list(range(8)) + [50, 51, 52], prompt_len=11)
    manager.allocate(second)
    assert second.num_computed_tokens == 8
    assert manager.num_prefix_hits == 2


def test_watermark_blocks_admission() -> None:
    manager = BlockManager(BLOCK, 100, 4, watermark=0.1, enable_caching=False)
    assert manager.can_allocate(make_seq(BLOCK * 90))
    assert not manager.can_allocate(make_seq(BLOCK * 91))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/grow/fork/swap/free sequences keep the pools consistent and leak nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(BLOCK, 24, 24, watermark=0.0, enable_caching=True)
        self.on_gpu: list[Sequence] = []
        self.on_cpu: list[list[Sequence]] = []
        self.next_token = 0

    @rule(length=st.integers(1, 12), reuse=st.booleans())
    def allocate(self, length: int, reuse: bool) -> None:
        start = 0 if reuse else 1000 + self.next_token
        self.next_token += length
        seq = make_seq(length, start)
        if self.manager.can_allocate(seq):
            self.manager.allocate(seq)
            compute(self.manager, seq, seq.num_uncomputed_tokens)
            self.on_gpu.append(seq)

    @precondition(lambda self: self.on_gpu)
    @rule(index=st.integers(0, 100), tokens=st.integers(1, 5))
    def grow(self, index: int, tokens: int) -> None:
        seq = self.on_gpu[index % len(self.on_gpu)]
        seq.token_ids.extend(range(7000, 7000 + tokens))
        if self.manager.num_blocks_needed(seq, tokens) <= self.manager.num_free_gpu_blocks:
            compute(self.manager, seq, tokens)
        else:
            del seq.token_ids[-tokens:]

    @precondition(lambda self: self.on_gpu)
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        parent = self.on_gpu[index % len(self.on_gpu)]
        child = parent.fork()
        self.manager.fork(parent, child)
        self.on_gpu.append(child)

    @precondition(lambda self: self.on_gpu)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        self.manager.free(self.on_gpu.pop(index % len(self.on_gpu)))

    @precondition(lambda self: self.on_gpu)
    @rule(index=st.integers(0, 100))
    def swap_out(self, index: int) -> None:
        seq = self.on_gpu[index % len(self.on_gpu)]
        if self.manager.can_swap_out([seq]):
            self.manager.swap_out([seq])
            self.on_gpu.remove(seq)
            self.on_cpu.append([seq])

    @precondition(lambda self: self.on_cpu)
    @rule()
    def swap_in(self) -> None:
        group = self.on_cpu[0]
        if self.manager.can_swap_in(group):
            self.manager.swap_in(group)
            self.on_cpu.pop(0)
            self.on_gpu.extend(group)

    @invariant()
    def pools_consistent(self) -> None:
        self.manager.gpu.check_invariants()
        self.manager.cpu.check_invariants()
        for pool, seqs in ((self.manager.gpu, self.on_gpu), (self.manager.cpu, [s for g in self.on_cpu for s in g])):
            refs = [0] * pool.num_blocks
            for seq in seqs:
                for block in self.manager.tables[seq.seq_id]:
                    refs[block] += 1
            assert refs == pool.ref_counts

    def teardown(self) -> None:
        for seq in self.on_gpu:
            self.manager.free(seq)
        for group in self.on_cpu:
            for seq in group:
                self.manager.free(seq, on_cpu=True)
        assert self.manager.num_free_gpu_blocks == 24
        assert self.manager.cpu.num_free_blocks == 24


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_block_manager_random_operations = BlockManagerMachine.TestCase
