"""Both backends reject bad arguments with a ValueError naming the argument, before launch,
whether they read the values from the device or from the caller's host copies."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import reference
from paged_kernels.checks import HostTables


@pytest.fixture(params=["reference", "triton"])
def backend(request, triton_ops):
    """Each backend in turn."""
    return reference if request.param == "reference" else triton_ops


@pytest.fixture
def case(make_case):
    """Two sequences of 5 and 20 tokens over 16-token blocks."""
    return make_case([5, 20])


@pytest.fixture(params=["device", "host"])
def values_from(request):
    """Where the checks read block ids and lengths: the device tensors or host copies of them."""
    return request.param


def decode(backend, case, values_from="device", **override):
    """Call decode with the case's arguments, some replaced; planned from host copies of the
    tables and lengths when ``values_from`` is "host"."""
    args = {
        "query": torch.randn(2, case.num_heads, 64),
        "key_cache": case.key_cache,
        "value_cache": case.value_cache,
        "block_tables": case.block_tables,
        "context_lens": case.context_lens,
        "scale": 0.125,
    } | override
    if values_from == "host":
        host = HostTables(args["block_tables"].tolist(), args["context_lens"].tolist())
        tensors = {k: v for k, v in args.items() if k != "scale"}
        args["plan"] = backend.plan_decode(**tensors, host=host)
    return backend.paged_attention_decode(**args)


def test_host_planned_decode_equals_device_planned(backend, case, assert_matches):
    query = torch.randn(2, case.num_heads, 64)
    assert_matches(decode(backend, case, "host", query=query), decode(backend, case, query=query))


def test_block_table_pointing_past_the_cache_is_rejected(backend, case, values_from):
    case.block_tables[1, 1] = case.key_cache.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        decode(backend, case, values_from)


def test_negative_block_id_inside_the_context_is_rejected(backend, case, values_from):
    case.block_tables[0, 0] = -1
    with pytest.raises(ValueError, match="block_tables"):
        decode(backend, case, values_from)


def test_context_longer_than_its_block_table_is_rejected(backend, case, values_from):
    capacity = case.block_tables.shape[1] * case.key_cache.shape[1]
    with pytest.raises(ValueError, match="context_lens"):
        decode(backend, case, values_from, context_lens=torch.tensor([5, capacity + 1], dtype=torch.int32))


def test_empty_context_is_rejected(backend, case, values_from):
    with pytest.raises(ValueError, match="context_lens"):
        decode(backend, case, values_from, context_lens=torch.tensor([0, 3], dtype=torch.int32))


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


def prefill(backend, case, num_tokens, starts, values_from):
    """Call prefill over ``num_tokens`` query rows split at ``starts``, as ``decode`` does."""
    args = (
        torch.randn(num_tokens, case.num_heads, 64), case.key_cache, case.value_cache,
        case.block_tables, torch.tensor(starts, dtype=torch.int32), case.context_lens,
    )
    plan = None
    if values_from == "host":
        host = HostTables(case.block_tables.tolist(), case.context_lens.tolist(), starts)
        plan = backend.plan_prefill(*args, host=host)
    return backend.paged_prefill_attention(*args, 0.125, plan=plan)


def test_query_start_loc_must_cover_the_query(backend, case, values_from):
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill(backend, case, 6, [0, 2, 5], values_from)


def test_more_queries_than_context_are_rejected(backend, case, values_from):
    with pytest.raises(ValueError, match="context_lens"):
        prefill(backend, case, 8, [0, 6, 8], values_from)


def test_slot_past_the_cache_is_rejected(backend, case):
    key = torch.randn(1, 2, 64)
    num_slots = case.key_cache.shape[0] * case.key_cache.shape[1]
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.reshape_and_cache(
            key, key, case.key_cache, case.value_cache, torch.tensor([num_slots])
        )


def test_slot_range_past_the_cache_is_rejected_without_reading_the_slots(backend, case):
    key = torch.randn(1, 2, 64)
    num_slots = case.key_cache.shape[0] * case.key_cache.shape[1]
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.reshape_and_cache(
            key, key, case.key_cache, case.value_cache, torch.tensor([0]), slot_range=(0, num_slots)
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


def test_host_copies_must_hold_one_offset_per_sequence_and_one_more(backend, case):
    query = torch.randn(6, case.num_heads, 64)
    starts = torch.tensor([0, 2, 6], dtype=torch.int32)
    host = HostTables(case.block_tables.tolist(), case.context_lens.tolist(), [0, 6])
    with pytest.raises(ValueError, match="query_start_loc"):
        backend.plan_prefill(
            query, case.key_cache, case.value_cache, case.block_tables, starts, case.context_lens, host=host
        )
