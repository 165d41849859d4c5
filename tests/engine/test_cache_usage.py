"""KV-cache usage and waste equal a hand count over known sequences, shared blocks counted once."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Sequence

BLOCK = 4


def computed_seq(manager: BlockManager, num_tokens: int, start: int) -> Sequence:
    seq = Sequence(token_ids=list(range(start, start + num_tokens)), prompt_len=num_tokens)
    manager.allocate(seq)
    manager.append_slots(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    return seq


def test_block_manager_usage_counts_shared_blocks_once() -> None:
    manager = BlockManager(BLOCK, 20, 4, watermark=0.0, enable_caching=False)
    parent = computed_seq(manager, 6, start=0)  # blocks of 4 + 2 tokens
    child = parent.fork()
    manager.fork(parent, child)
    child.token_ids.append(99)  # copy-on-write: the child gets its own last block of 3 tokens
    manager.append_slots(child, 1)
    other = computed_seq(manager, 9, start=100)  # 4 + 4 + 1 tokens
    usage = manager.usage([parent, child, other])
    # blocks: shared first block, parent's last, child's last, other's three
    assert usage.num_used_blocks == 1 + 1 + 1 + 3
    assert usage.num_filled_slots == 4 + 2 + 3 + 9


def test_engine_waste_ratio_and_usage_match_a_hand_count(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, length in enumerate([5, 16, 17]):
        engine.add_request(f"single-{i}", list(range(100 * (i + 1), 100 * (i + 1) + length)), greedy)
    pair = SamplingParams(max_tokens=40, n=2, temperature=1.0, seed=1, ignore_eos=True)
    engine.add_request("pair", list(range(900, 920)), pair)
    # block size 16. After the prefill step every sequence holds its prompt and one sampled token, each in
    # the blocks it has so far: 6 | 16 (the 17th token gets its block next step) | 16+2 | the pair's 16+5,
    # which both samples still share (one sampled token each, written on the next step).
    engine.step()
    assert_usage(llm, used_blocks=1 + 1 + 2 + 2, filled_slots=6 + 16 + 18 + 21)
    # next step: the pair's samples write different tokens into their shared last block: one copies it
    engine.step()
    assert_usage(llm, used_blocks=1 + 2 + 2 + 3, filled_slots=7 + 18 + 19 + (16 + 6 + 6))


def assert_usage(llm: LLM, used_blocks: int, filled_slots: int) -> None:
    stats = llm.stats()
    assert stats.num_total_blocks - stats.num_free_blocks == used_blocks
    assert stats.kv_cache_usage == pytest.approx(used_blocks / stats.num_total_blocks)
    assert stats.kv_cache_waste_ratio == pytest.approx(1 - filled_slots / (used_blocks * stats.block_size))
