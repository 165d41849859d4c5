"""Compiled kernels at serving sizes: long contexts, many partitions, big prefill chunks."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_over_long_uneven_contexts(triton_ops, make_case, assert_matches, dtype):
    case = make_case(
        [1, 511, 512, 513, 3000, 8191], num_heads=32, num_kv_heads=8, head_dim=128,
        dtype=dtype, device="cuda",
    )
    query = torch.randn(6, 32, 128, device="cuda", dtype=dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.context_lens, 0.088)
    assert_matches(
        triton_ops.paged_attention_decode(*args), reference.paged_attention_decode(*args)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_chunks_after_long_cached_prefixes(triton_ops, make_case, assert_matches, dtype):
    case = make_case(
        [700, 2048, 300], num_heads=16, num_kv_heads=4, head_dim=128, dtype=dtype, device="cuda"
    )
    starts = torch.tensor([0, 200, 712, 1012], dtype=torch.int32, device="cuda")
    query = torch.randn(1012, 16, 128, device="cuda", dtype=dtype)
    args = (
        query, case.key_cache, case.value_cache, case.block_tables, starts, case.context_lens,
        0.088,
    )
    assert_matches(
        triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args)
    )


def test_decode_of_one_long_sequence_split_over_the_sms(triton_ops, make_case, assert_matches):
    # One sequence: the plan splits it into many short partitions (more than one merge chunk).
    case = make_case([16000], num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    plan = triton_ops.plan_decode(*args)
    assert plan.num_partitions > 1
    assert_matches(
        triton_ops.paged_attention_decode(*args, 0.088, plan=plan), reference.paged_attention_decode(*args, 0.088)
    )


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 256), (torch.bfloat16, 256), (torch.bfloat16, 64)])
def test_prefill_tiles_chosen_for_the_device_compile_and_match(triton_ops, make_case, assert_matches, dtype, head_dim):
    # fp32 at head_dim 256 is the tightest fit in shared memory; 3 heads per KV head leave rows idle.
    case = make_case([600, 129], num_heads=9, num_kv_heads=3, head_dim=head_dim, dtype=dtype, device="cuda")
    starts = torch.tensor([0, 600, 729], dtype=torch.int32, device="cuda")
    query = torch.randn(729, 9, head_dim, device="cuda", dtype=dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, starts, case.context_lens, 0.1)
    assert_matches(
        triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args)
    )
