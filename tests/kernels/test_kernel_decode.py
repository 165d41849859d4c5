"""The Triton decode kernel matches the torch reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from paged_kernels import reference
from paged_kernels.launch import (
    DEEP_PARTITION_TOKENS,
    MAX_PARTITION_TOKENS,
    MIN_PARTITION_TOKENS,
    DecodeSplit,
    DeviceLimits,
    choose_decode_split,
)
from paged_kernels.triton_decode import REDUCE_CHUNK, partition_length

H100 = DeviceLimits(sm_count=132, shared_memory_bytes=227 * 1024, compiled=True)

SCALE = 0.125


def run_both(triton_ops, case, dtype: torch.dtype = torch.float32, num_partitions: int | None = None,
             **plan_fields: int):
    """Decode one random query per sequence with both backends; the Triton one splitting each context
    ``num_partitions`` ways when given (else as planned for the device), with other plan fields replaced."""
    head_dim = case.key_cache.shape[3]
    query = torch.randn(len(case.context_lens), case.num_heads, head_dim)
    query = query.to(device=case.key_cache.device, dtype=dtype)
    tensors = (query, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    plan = triton_ops.plan_decode(*tensors)
    if num_partitions is not None:
        plan = replace(plan, num_partitions=num_partitions, fill_partitions=num_partitions, deep_partitions=1)
    plan = replace(plan, **plan_fields)
    return (
        triton_ops.paged_attention_decode(*tensors, SCALE, plan=plan),
        reference.paged_attention_decode(*tensors, SCALE),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_decode_matches_reference_for_every_head_dim(
    triton_ops, make_case, assert_matches, device, head_dim, dtype
):
    # Context 1, a partial last block, and an exactly full block; tables padded with -1.
    case = make_case([1, 21, 32], head_dim=head_dim, dtype=dtype, device=device)
    assert_matches(*run_both(triton_ops, case, dtype))


def test_decode_accepts_fp16(triton_ops, make_case, assert_matches, device):
    case = make_case([5, 40], dtype=torch.float16, device=device)
    assert_matches(*run_both(triton_ops, case, torch.float16))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2), (8, 1), (16, 2)])
def test_decode_matches_reference_for_gqa_ratios(
    triton_ops, make_case, assert_matches, device, num_heads, num_kv_heads
):
    case = make_case([3, 30], num_heads=num_heads, num_kv_heads=num_kv_heads, device=device)
    assert_matches(*run_both(triton_ops, case))


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_decode_matches_reference_for_block_sizes(
    triton_ops, make_case, assert_matches, device, block_size
):
    case = make_case([1, block_size + 3, 70], block_size=block_size, device=device)
    assert_matches(*run_both(triton_ops, case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_merges_partitions_of_long_contexts(triton_ops, make_case, assert_matches, device, dtype):
    # Split 4 ways in whole 64-token tiles: contexts of 1, 2 and 4 partitions, ending on and off their edges.
    case = make_case([1, 64, 65, 200], block_size=8, dtype=dtype, device=device)
    assert_matches(*run_both(triton_ops, case, dtype, num_partitions=4))


@pytest.mark.parametrize(("head_dim", "num_partitions"), [(64, 2), (64, 3), (256, 3)])
def test_decode_merges_partitions_of_several_tiles_each(
    triton_ops, make_case, assert_matches, device, head_dim, num_partitions
):
    # Shares longer than the 64-token minimum, in whole tiles (64 tokens at head_dim 64, 16 at 256 in fp32):
    # 600 tokens split 2 ways is 320 + 280, 3 ways 256 + 256 + 88 (tiles of 64) or 208 + 208 + 184 (tiles of 16).
    case = make_case([600, 70], head_dim=head_dim, device=device)
    assert_matches(*run_both(triton_ops, case, num_partitions=num_partitions))


def test_a_context_longer_than_the_longest_partition_is_split_beyond_the_fill(
    triton_ops, make_case, assert_matches, device
):
    # a grid of 4 partitions, filled 1 way, partitions of at most 128 tokens: 100 tokens take one partition,
    # 300 take three (128 + 128 + 44), 500 take four; the merge must read as many as were written
    case = make_case([100, 300, 500], device=device)
    assert_matches(*run_both(triton_ops, case, num_partitions=4, fill_partitions=1, max_partition_tokens=128))


def test_long_contexts_split_the_deep_way_where_it_gives_more_partitions(triton_ops, make_case, assert_matches, device):
    # one partition per context the spread way; up to 4 of at least 256 tokens the deep way: 300 tokens run as one,
    # 1,100 as 4 shares of 320 (whole 64-token tiles: 320 + 320 + 320 + 140)
    case = make_case([300, 1100], device=device)
    assert device_partition_lengths(DecodeSplit(partitions=4, fill=1, deep=4), [300, 1100], device) == [320, 320]
    assert_matches(*run_both(triton_ops, case, num_partitions=4, fill_partitions=1, deep_partitions=4))


@triton.jit
def _partition_lengths_kernel(out_ptr, lens_ptr, fill, deep, max_tokens, TILE: tl.constexpr,
                              MIN_TOKENS: tl.constexpr, DEEP_TOKENS: tl.constexpr):
    index = tl.program_id(0)
    length = partition_length(tl.load(lens_ptr + index), fill, deep, max_tokens, TILE, MIN_TOKENS, DEEP_TOKENS)
    tl.store(out_ptr + index, length)


def device_partition_lengths(split: DecodeSplit, lens: list[int], device: str, tile: int = 64) -> list[int]:
    """What ``partition_length`` gives each context under ``split``, at ``tile``-token tiles."""
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.empty_like(context_lens)
    _partition_lengths_kernel[(len(lens),)](out, context_lens, split.fill, split.deep, MAX_PARTITION_TOKENS,
                                            TILE=tile, MIN_TOKENS=MIN_PARTITION_TOKENS,
                                            DEEP_TOKENS=DEEP_PARTITION_TOKENS)
    return out.tolist()


@pytest.mark.parametrize("num_seqs", [1, 8, 32, 256])
def test_a_split_made_for_the_tables_capacity_splits_each_context_as_its_own_would(device, num_seqs):
    # what a CUDA graph replays: the split of 32k-token tables, on an H100/H200's 132 SMs, 8 KV heads
    lens = [1, 63, 64, 65, 300, 1024, 2048, 4000, 8192, 20000, 32768]
    capacity = device_partition_lengths(choose_decode_split(num_seqs, 8, 32768, H100), lens, device)
    own = [device_partition_lengths(choose_decode_split(num_seqs, 8, n, H100), [n], device)[0] for n in lens]
    assert capacity == own


@pytest.mark.parametrize("tile", [16, 32, 64])
def test_no_partition_is_shorter_than_the_minimum_at_any_tile(device, tile):
    # 65 tokens split 2 ways would be 33 (48 in tiles of 16): the minimum, 64, holds them; 130 split 2 ways is 65,
    # rounded up to whole tiles
    split = DecodeSplit(partitions=2, fill=2, deep=1)
    assert device_partition_lengths(split, [65, 130, 1], device, tile) == [64, {16: 80, 32: 96, 64: 128}[tile], 64]


@pytest.mark.parametrize(("num_seqs", "context_len", "tokens"), [(1, 1024, 64), (1, 8192, 256), (8, 2048, 256)])
def test_a_graphed_split_runs_the_partitions_the_h200_sweep_found_fastest(device, num_seqs, context_len, tokens):
    # BENCHMARKS.md, seventeenth session: 1 x 1k fastest as 16 x 64 tokens, 1 x 8k as 32 x 256, 8 x 2k as 8 x 256
    split = choose_decode_split(num_seqs, 8, 32768, H100)
    assert device_partition_lengths(split, [context_len], device) == [tokens]


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_partitions": 2, "fill_partitions": 3}, "fill_partitions"),
    ({"num_partitions": 2, "fill_partitions": 1, "deep_partitions": 3}, "deep_partitions"),
    ({"num_partitions": 1, "fill_partitions": 1, "max_partition_tokens": 64}, "max_context_len"),
])
def test_a_plan_whose_grid_cannot_hold_its_partitions_is_refused(triton_ops, make_case, device, fields, named):
    case = make_case([100, 300], device=device)
    query = torch.randn(2, case.num_heads, 64, device=device)
    plan = triton_ops.plan_decode(query, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    with pytest.raises(ValueError, match=named):
        replace(plan, **fields)


def test_decode_merges_more_partitions_than_one_merge_step_reads(triton_ops, make_case, assert_matches, device):
    # The longest context splits into more than REDUCE_CHUNK partitions of 64 tokens; the shorter into one.
    case = make_case([33, 64 * REDUCE_CHUNK + 45], num_heads=8, num_kv_heads=2, device=device)
    assert_matches(*run_both(triton_ops, case, num_partitions=REDUCE_CHUNK + 1))


def test_decode_reads_a_block_table_padded_with_garbage(
    triton_ops, make_case, assert_matches, device
):
    case = make_case([9, 17], device=device)
    case.block_tables[0, 1:] = 10_000  # past the cache, but past the context too
    assert_matches(*run_both(triton_ops, case))


def test_decode_of_an_empty_batch_is_empty(triton_ops, make_case, device):
    case = make_case([4], device=device)
    query = torch.randn(0, case.num_heads, 64, device=device)
    out = triton_ops.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables[:0], case.context_lens[:0], SCALE
    )
    assert out.shape == (0, case.num_heads, 64)


def test_a_static_plan_is_sized_by_the_tables_capacity_and_holds_as_lengths_change(
    triton_ops, make_case, assert_matches, device
):
    # what a CUDA graph bakes in: one plan, then new lengths written into the same tensors
    case = make_case([64, 130, 200], device=device)  # tables of 13 + 3 spare columns: 256 tokens
    query = torch.randn(3, case.num_heads, 64, device=device)
    tensors = (query, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    plan = triton_ops.plan_decode_static(*tensors)
    assert plan.max_context_len == case.block_tables.shape[1] * 16
    # each context split up to 4 ways: the merge runs
    plan = replace(plan, num_partitions=4, fill_partitions=4, deep_partitions=1)
    for lens in ([64, 130, 200], [1, 65, 190], [40, 128, 129]):
        case.context_lens.copy_(torch.tensor(lens))
        assert triton_ops.plan_decode_static(*tensors).max_context_len == plan.max_context_len
        assert_matches(triton_ops.paged_attention_decode(*tensors, SCALE, plan=plan),
                       reference.paged_attention_decode(*tensors, SCALE))
