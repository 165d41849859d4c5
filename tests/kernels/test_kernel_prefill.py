"""The Triton prefill kernel matches the torch reference."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import reference

SCALE = 0.125


def run_both(triton_ops, case, num_queries: list[int], dtype: torch.dtype = torch.float32):
    """Attend ``num_queries[i]`` new tokens (the last of each context) with both backends."""
    head_dim = case.key_cache.shape[3]
    device = case.key_cache.device
    starts = torch.tensor([0, *num_queries], device=device).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), case.num_heads, head_dim)
    query = query.to(device=device, dtype=dtype)
    args = (
        query, case.key_cache, case.value_cache, case.block_tables, starts, case.context_lens,
        SCALE,
    )
    return triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_prefill_matches_reference_for_every_head_dim(
    triton_ops, make_case, assert_matches, device, head_dim, dtype
):
    # A one-token prompt, a whole prompt, and new tokens after a cached prefix.
    case = make_case([1, 21, 45], head_dim=head_dim, dtype=dtype, device=device)
    assert_matches(*run_both(triton_ops, case, [1, 21, 6], dtype))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_prefill_matches_reference_for_gqa_ratios(
    triton_ops, make_case, assert_matches, device, num_heads, num_kv_heads
):
    case = make_case([7, 19], num_heads=num_heads, num_kv_heads=num_kv_heads, device=device)
    assert_matches(*run_both(triton_ops, case, [7, 4]))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (9, 3)])
def test_grouped_heads_match_reference_over_odd_lengths_and_several_token_runs(
    triton_ops, make_case, assert_matches, device, head_dim, num_heads, num_kv_heads
):
    # 4 and 3 (not a power of two) query heads per KV head; 37 and 11 new tokens need several
    # programs per group; blocks scattered over the cache with unused ones between them.
    case = make_case(
        [37, 29], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=8,
        device=device,
    )
    assert_matches(*run_both(triton_ops, case, [37, 11]))


def test_a_group_wider_than_a_row_tile_gets_one_token_per_program(
    triton_ops, make_case, assert_matches, device
):
    case = make_case([5, 3], num_heads=64, num_kv_heads=1, head_dim=16, device=device)
    assert_matches(*run_both(triton_ops, case, [5, 2]))


@pytest.mark.parametrize("block_size", [8, 128])
def test_prefill_matches_reference_for_block_sizes(
    triton_ops, make_case, assert_matches, device, block_size
):
    case = make_case([13, 30], block_size=block_size, device=device)
    assert_matches(*run_both(triton_ops, case, [13, 9]))


def test_prefill_spans_several_row_tiles_and_skips_empty_sequences(
    triton_ops, make_case, assert_matches, device
):
    # 70 queries need several programs; the middle sequence has no new tokens.
    case = make_case([80, 12, 70], num_heads=2, num_kv_heads=1, device=device)
    assert_matches(*run_both(triton_ops, case, [70, 0, 70]))
