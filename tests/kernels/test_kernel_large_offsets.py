"""Kernels address caches of more than 2^31 elements (int64 pointer math).

The caches are allocated with ``torch.empty`` and only a few blocks near their end are
written: the operating system commits just the touched pages, so two caches of 4 GiB
(virtual) each cost a few MiB of RAM on a CPU run. Interpreted kernels that computed these
offsets in int32 would wrap around and crash or read the wrong block.
"""

from __future__ import annotations

import pytest
import torch

from paged_kernels import reference

BLOCK_SIZE, HEAD_DIM = 16, 64
BLOCK_NUMEL = BLOCK_SIZE * HEAD_DIM
NUM_BLOCKS = 2**31 // BLOCK_NUMEL + 4  # blocks from 2**21 on start past element 2**31
HIGH_BLOCKS = [NUM_BLOCKS - 3, NUM_BLOCKS - 1]


@pytest.fixture
def huge_caches(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches of ``NUM_BLOCKS`` bf16 blocks (one KV head) with random high blocks."""
    try:
        caches = tuple(
            torch.empty(NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM, dtype=torch.bfloat16, device=device)
            for _ in range(2)
        )
    except (RuntimeError, MemoryError) as error:  # e.g. overcommit disabled
        pytest.skip(f"cannot reserve 2 x 4 GiB of address space: {error}")
    for cache in caches:
        cache[HIGH_BLOCKS] = torch.randn(2, BLOCK_SIZE, 1, HEAD_DIM, device=device).bfloat16()
    return caches


def test_cache_offsets_past_2_31_elements(triton_ops, huge_caches, device, assert_matches):
    key_cache, value_cache = huge_caches
    assert key_cache.numel() > 2**31 and HIGH_BLOCKS[0] * BLOCK_NUMEL > 2**31
    first_slot = HIGH_BLOCKS[1] * BLOCK_SIZE

    # reshape_and_cache: write three tokens into the last block.
    new = torch.randn(3, 1, HEAD_DIM, device=device).bfloat16()
    slots = torch.arange(first_slot, first_slot + 3, device=device)
    triton_ops.reshape_and_cache(new, new, key_cache, value_cache, slots)
    assert torch.equal(key_cache[HIGH_BLOCKS[1], :3], new)

    # copy_blocks: duplicate the last block into the one before it.
    mapping = torch.tensor([[HIGH_BLOCKS[1], NUM_BLOCKS - 2]], device=device)
    triton_ops.copy_blocks([key_cache], [value_cache], mapping)
    assert torch.equal(value_cache[NUM_BLOCKS - 2], value_cache[HIGH_BLOCKS[1]])

    # Decode and prefill read both high blocks through the block table.
    block_tables = torch.tensor([HIGH_BLOCKS], dtype=torch.int32, device=device)
    context_lens = torch.tensor([BLOCK_SIZE + 3], dtype=torch.int32, device=device)
    query = torch.randn(4, 2, HEAD_DIM, device=device).bfloat16()
    decode_args = (query[:1], key_cache, value_cache, block_tables, context_lens, 0.125)
    assert_matches(
        triton_ops.paged_attention_decode(*decode_args),
        reference.paged_attention_decode(*decode_args),
    )
    starts = torch.tensor([0, 4], dtype=torch.int32, device=device)
    prefill_args = (query, key_cache, value_cache, block_tables, starts, context_lens, 0.125)
    assert_matches(
        triton_ops.paged_prefill_attention(*prefill_args),
        reference.paged_prefill_attention(*prefill_args),
    )
