"""Both backends reject bad arguments with a ValueError naming the argument, before launch."""

from __future__ import annotations

import pytest
import torch

from kernels import reference


@pytest.fixture(params=["reference", "triton"])
def backend(request, triton_ops):
    """Each backend in turn."""
    return reference if request.param == "reference" else triton_ops


@pytest.fixture
def case(make_case):
    """Two sequences of 5 and 20 tokens over 16-token blocks."""
    return make_case([5, 20])


def decode(backend, case, **override):
    """Call decode with the case's arguments, some replaced."""
    args = {
        "query": torch.randn(2, case.num_heads, 64),
        "key_cache": case.key_cache,
        "value_cache": case.value_cache,
        "block_tables": case.block_tables,
        "context_lens": case.context_lens,
        "scale": 0.125,
    } | override
    return backend.paged_attention_decode(**args)


def test_block_table_pointing_past_the_cache_is_rejected(backend, case):
    case.block_tables[1, 1] = case.key_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        decode(backend, case)


def test_negative_block_id_inside_the_context_is_rejected(backend, case):
    case.block_tables[0, 0] = -1
    with pytest.raises(ValueError, match="block_tables"):
        decode(backend, case)


def test_context_longer_than_its_block_table_is_rejected(backend, case):
    capacity = case.block_tables.shape[1] * case.key_cache.shape[1]
    with pytest.raises(ValueError, match="context_lens"):
        decode(backend, case, context_lens=torch.tensor([5, capacity + 1], dtype=torch.int32))


def test_empty_context_is_rejected(backend, case):
    with pytest.raises(ValueError, match="context_lens"):
        decode(backend, case, context_lens=torch.tensor([0, 3], dtype=torch.int32))


def test_query_head_dim_must_match_the_cache(backend, case):
    with pytest.raises(ValueError, match="head_dim"):
        decode(backend, case, query=torch.randn(2, case.num_heads, 32))


def test_query_heads_must_be_a_multiple_of_kv_heads(backend, case):
    with pytest.raises(ValueError, match="num_kv_heads"):
        decode(backend, case, query=torch.randn(2, 5, 64))


def test_value_cache_dtype_must_match_key_cache(backend, case):
    with pytest.raises(ValueError, match="value_cache dtype"):
        decode(backend, case, value_cache=case.value_cache.to(torch.bfloat16))


def test_float_block_tables_are_rejected(backend, case):
    with pytest.raises(ValueError, match="block_tables"):
        decode(backend, case, block_tables=case.block_tables.float())


def test_one_table_row_per_sequence_is_required(backend, case):
    with pytest.raises(ValueError, match="block_tables"):
        decode(backend, case, block_tables=case.block_tables[:1])


def test_query_start_loc_must_cover_the_query(backend, case):
    query = torch.randn(6, case.num_heads, 64)
    starts = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        backend.paged_prefill_attention(
            query, case.key_cache, case.value_cache, case.block_tables, starts,
            case.context_lens, 0.125,
        )


def test_more_queries_than_context_are_rejected(backend, case):
    query = torch.randn(8, case.num_heads, 64)
    starts = torch.tensor([0, 6, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens"):
        backend.paged_prefill_attention(
            query, case.key_cache, case.value_cache, case.block_tables, starts,
            case.context_lens, 0.125,
        )


def test_slot_past_the_cache_is_rejected(backend, case):
    key = torch.randn(1, 2, 64)
    num_slots = case.key_cache.shape[0] * case.key_cache.shape[1]
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.reshape_and_cache(
            key, key, case.key_cache, case.value_cache, torch.tensor([num_slots])
        )


def test_key_shape_must_match_the_cache(backend, case):
    key = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match="key must be"):
        backend.reshape_and_cache(key, key, case.key_cache, case.value_cache, torch.tensor([0]))


def test_copy_mapping_past_the_cache_is_rejected(backend, case):
    mapping = torch.tensor([[0, case.key_cache.shape[0]]])
    with pytest.raises(ValueError, match="block_mapping"):
        backend.copy_blocks([case.key_cache], [case.value_cache], mapping)


def test_swap_between_different_block_shapes_is_rejected(backend, case):
    other = torch.zeros(4, 8, 2, 64)
    with pytest.raises(ValueError, match="block shape"):
        backend.swap_blocks(case.key_cache, other, torch.tensor([[0, 0]]))
