"""The CPU backend's compiled decode attention equals plain per-token attention, its cache writes put each row in its
slot, and it is what the CPU runs."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from paged_kernels import cpu_ops, reference, select_backend
from paged_kernels.checks import HostTables
from paged_kernels.cpu_extension import cpu_kernels


def naive_decode(query, key_cache, value_cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """Sequence by sequence: softmax(q·k) over its whole context, GQA by repeating KV heads; computed in fp64 and
    rounded to fp32 once (an fp32 oracle's own rounding reached 1.7e-5 at scale 4.0 on a Sapphire Rapids Xeon,
    ten times the kernel's error there)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float32)
    for s, length in enumerate(lens):
        slots = [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(length)]
        keys = key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        values = value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[s].double(), keys) * scale
        out[s] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out


def _case(context_lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int,
          dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Random caches (in ``cache_dtype``, default ``dtype``), a query per sequence, and tables of scattered blocks
    padded with -1 past each context."""
    cache_dtype = cache_dtype or dtype
    num_seqs = len(context_lens)
    width = max(-(-length // block_size) for length in context_lens) + 1
    num_blocks = num_seqs * width + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    tables = torch.full((num_seqs, width), -1, dtype=torch.int32)
    blocks = torch.randperm(num_blocks).to(torch.int32).tolist()
    for s, length in enumerate(context_lens):
        used = -(-length // block_size)
        tables[s, :used] = torch.tensor(blocks[s * width : s * width + used])
    query = torch.randn(num_seqs, heads, dim).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def test_the_cpu_kernels_build_here() -> None:
    # a C++ compiler and ninja are part of the engine's install: without them the CPU falls back to SDPA,
    # three times slower per decode step, so a machine that cannot build them fails here rather than skip
    assert cpu_kernels() is not None


@pytest.mark.parametrize(
    ("context_lens", "block_size", "heads", "kv_heads", "dim"),
    [([1, 2, 17, 160], 16, 9, 3, 64),  # SmolLM2's heads, a context of one token, partial blocks
     ([33, 5], 1, 4, 4, 32),  # one token per block, no grouping
     ([70, 3, 40, 66, 17, 9, 1], 8, 8, 2, 128),  # group of 4, head_dim 128, more sequences than threads
     ([12, 31], 4, 6, 1, 40),  # one KV head for all, five vectors of 8 per head
     ([8, 16, 23], 16, 2, 1, 36),  # a head_dim that is no multiple of the vector width (4 values left over)
     ([5, 130], 16, 4, 2, 80)],  # ten vectors per head: a run of eight, then two
)
@pytest.mark.parametrize("scale", [0.125, 4.0])  # 4.0: scores far apart, most weights e^-87 or less
def test_compiled_decode_matches_naive_attention(
    context_lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, scale: float,
) -> None:
    torch.manual_seed(0)
    query, key_cache, value_cache, tables, lens = _case(context_lens, block_size, heads, kv_heads, dim)
    plan = cpu_ops.plan_decode(query, key_cache, value_cache, tables, lens,
                               host=HostTables(tables.tolist(), context_lens))
    assert isinstance(plan, cpu_ops.CompiledDecodePlan)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, scale, plan=plan)
    expected = naive_decode(query, key_cache, value_cache, tables, context_lens, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("context_lens", "block_size", "heads", "kv_heads", "dim"),
    [([20, 45, 3], 16, 6, 2, 64),  # groups of 3: one pass of the register-held group
     ([9, 70], 8, 8, 1, 36),  # a group of 8 (passes of 3, 3 and 2 heads); 4 values past the last whole vector
     ([33, 130], 4, 10, 2, 80)],  # groups of 5 (3 + 2); a tile of eight vectors, then two
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_caches_decode_compiled(
    context_lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
) -> None:
    torch.manual_seed(1)
    query, key_cache, value_cache, tables, lens = _case(context_lens, block_size, heads, kv_heads, dim, dtype)
    plan = cpu_ops.plan_decode(query, key_cache, value_cache, tables, lens)
    assert isinstance(plan, cpu_ops.CompiledDecodePlan)  # AMX tiles or not: the kernel outruns gather + SDPA
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, plan=plan)
    assert out.dtype == dtype
    expected = naive_decode(query, key_cache, value_cache, tables, context_lens, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("context_lens", "block_size", "heads", "kv_heads", "dim"),
    [([1, 2, 17, 160], 16, 9, 3, 64), ([9, 70], 8, 8, 1, 36), ([33, 300], 4, 10, 2, 80)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_fp32_queries_decode_compiled_over_16_bit_caches(
    context_lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype,
) -> None:
    # an fp32 model's fp16 (or bf16) cache (EngineConfig.kv_cache_dtype): the rows are widened as they are read, so
    # the result is fp32 attention over the cache's values, as exact as over an fp32 cache
    torch.manual_seed(7)
    query, key_cache, value_cache, tables, lens = _case(context_lens, block_size, heads, kv_heads, dim,
                                                        torch.float32, cache_dtype)
    plan = cpu_ops.plan_decode(query, key_cache, value_cache, tables, lens)
    assert isinstance(plan, cpu_ops.CompiledDecodePlan)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, plan=plan)
    assert out.dtype == torch.float32
    expected = naive_decode(query, key_cache, value_cache, tables, context_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_cache_wider_than_the_query_is_refused_by_the_kernel_and_left_to_the_reference() -> None:
    query, key_cache, value_cache, tables, lens = _case([9, 30], 8, 4, 2, 16, torch.bfloat16, torch.float32)
    kernels = cpu_kernels()
    assert kernels is not None
    with pytest.raises(RuntimeError, match="16-bit under an fp32 query"):
        kernels.paged_decode(query, key_cache, value_cache, tables, lens, 0.25)
    plan = cpu_ops.plan_decode(query, key_cache, value_cache, tables, lens)
    assert isinstance(plan, reference.AttentionPlan)


@pytest.mark.x86_builds
@pytest.mark.parametrize(("dtype", "cache_dtype", "tolerance"),
                         [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
                          (torch.float16, torch.float16, 2e-2), (torch.float32, torch.float16, 1e-5)])
def test_the_avx2_build_decodes_like_naive_attention(avx2_kernels: ModuleType, dtype: torch.dtype,
                                                     cache_dtype: torch.dtype, tolerance: float) -> None:
    torch.manual_seed(3)
    for context_lens, block_size, heads, kv_heads, dim in [([1, 17, 160], 16, 9, 3, 64), ([70, 3], 8, 8, 2, 128),
                                                            ([9, 40], 8, 8, 1, 36)]:
        query, key_cache, value_cache, tables, lens = _case(context_lens, block_size, heads, kv_heads, dim, dtype,
                                                            cache_dtype)
        out = avx2_kernels.paged_decode(query, key_cache, value_cache, tables, lens, 0.125)
        expected = naive_decode(query, key_cache, value_cache, tables, context_lens, 0.125)
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("context_lens", "threads"), [([300], 2), ([700, 64, 130], 4), ([63, 300], 5),
                                                     ([300, 260, 400], 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_sequences_than_threads_split_their_contexts_and_merge_them(
    context_lens: list[int], threads: int, dtype: torch.dtype,
) -> None:
    # contexts in parts of at least 128 positions where the sequences alone would leave threads idle (one sequence on
    # two threads, three on two or four), merged by each part's softmax max and total: 63, 64 and 130 positions
    # stay whole, 700 take four parts on four threads
    torch.manual_seed(6)
    query, key_cache, value_cache, tables, lens = _case(context_lens, 16, 9, 3, 64, dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
        torch.set_num_threads(1)  # one task per sequence: the whole context at once
        whole = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(previous)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected = naive_decode(query, key_cache, value_cache, tables, context_lens, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out, whole, atol=tolerance, rtol=tolerance)


def test_compiled_decode_reads_query_rows_at_their_stride() -> None:
    # the model hands the kernel the query part of its fused projection: rows 2x wider than the heads
    torch.manual_seed(4)
    query, key_cache, value_cache, tables, lens = _case([7, 40, 1], 8, 6, 2, 32, torch.bfloat16)
    fused = torch.cat([query, torch.randn_like(query)], dim=1)
    strided = fused[:, :6]
    plan = cpu_ops.plan_decode(strided, key_cache, value_cache, tables, lens)
    assert isinstance(plan, cpu_ops.CompiledDecodePlan) and strided.stride(0) == 2 * 6 * 32
    out = cpu_ops.paged_attention_decode(strided, key_cache, value_cache, tables, lens, 0.125, plan=plan)
    assert torch.equal(out, cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125))


def cache_written_row_by_row(key, value, key_cache, value_cache, slots):  # type: ignore[no-untyped-def]
    """The oracle of a cache write: each token's K and V rows assigned to their slot, one by one (-1: none)."""
    keys, values = key_cache.clone().flatten(0, 1), value_cache.clone().flatten(0, 1)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            keys[slot], values[slot] = key[token].to(keys.dtype), value[token].to(values.dtype)
    return keys.view_as(key_cache), values.view_as(value_cache)


@pytest.mark.parametrize(("dtype", "slot_dtype"), [(torch.float32, torch.int64), (torch.bfloat16, torch.int32),
                                                   (torch.float16, torch.int64)])
def test_compiled_cache_write_puts_each_row_in_its_slot(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    key_cache, value_cache = (torch.randn(6, 4, 3, 20).to(dtype) for _ in range(2))
    fused = torch.randn(5, 9, 20).to(dtype)  # K and V as strided views of one projection, as the model has them
    key, value = fused[:, 3:6], fused[:, 6:9]
    slots = torch.tensor([0, -1, 23, 9, 10], dtype=slot_dtype)
    expected = cache_written_row_by_row(key, value, key_cache, value_cache, slots)
    cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slots, slot_range=(-1, 23))
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_fp32_rows_written_to_a_16_bit_cache_round_as_the_reference_rounds_them(cache_dtype: torch.dtype) -> None:
    # 20 values a row: two whole vectors of 8 converted at once (F16C for fp16), then 4 one by one
    torch.manual_seed(8)
    key_cache, value_cache = (torch.zeros(3, 4, 1, 20, dtype=cache_dtype) for _ in range(2))
    fused = torch.randn(4, 2, 20) * torch.tensor([1e-3, 1.0, 3e4, 7e4]).view(4, 1, 1)  # 7e4 overflows fp16: inf
    key, value = fused[:, :1], fused[:, 1:]
    slots = torch.tensor([7, 1, -1, 11], dtype=torch.int32)
    expected = cache_written_row_by_row(key, value, key_cache, value_cache, slots)
    cpu_ops.reshape_and_cache(key, value, key_cache, value_cache, slots, slot_range=(-1, 11))
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    kernels = cpu_kernels()
    assert kernels is not None  # the compiled write converts them: the same rows again, through it alone
    key_cache.zero_(), value_cache.zero_()
    kernels.write_kv_cache_(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


def test_a_cache_write_to_a_wider_cache_or_out_of_range_is_the_reference_s() -> None:
    key_cache, value_cache = (torch.zeros(2, 4, 1, 8) for _ in range(2))
    key = torch.randn(2, 1, 8).bfloat16()  # bf16 rows into an fp32 cache: converted, as the reference does
    slots = torch.tensor([7, 1])
    expected = cache_written_row_by_row(key, key, key_cache, value_cache, slots)
    cpu_ops.reshape_and_cache(key, key, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])
    with pytest.raises(ValueError, match=r"slot_mapping must be -1 or in \[0, 8\)"):
        cpu_ops.reshape_and_cache(key.float(), key.float(), key_cache, value_cache, torch.tensor([8, 0]))


def test_compiled_decode_checks_its_arguments_like_the_reference() -> None:
    query, key_cache, value_cache, tables, lens = _case([10, 20], 8, 4, 2, 16)
    lens[1] = 8 * tables.shape[1] + 1  # past the table's blocks
    with pytest.raises(ValueError, match="context"):
        cpu_ops.plan_decode(query, key_cache, value_cache, tables, lens)
    plan = cpu_ops.plan_decode(query[:1], key_cache, value_cache, tables[:1], lens[:1])
    with pytest.raises(ValueError, match="plan covers 1 query rows, query has 2"):
        cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.25, plan=plan)


def test_a_non_contiguous_cache_falls_back_to_the_reference() -> None:
    torch.manual_seed(2)
    query, key_cache, value_cache, tables, lens = _case([9, 30], 8, 4, 2, 16)
    strided_keys, strided_values = (torch.cat([cache, cache], dim=-1)[..., :16] for cache in (key_cache, value_cache))
    plan = cpu_ops.plan_decode(query, strided_keys, strided_values, tables, lens)
    assert isinstance(plan, reference.AttentionPlan)
    out = cpu_ops.paged_attention_decode(query, strided_keys, strided_values, tables, lens, 0.25, plan=plan)
    torch.testing.assert_close(out, naive_decode(query, key_cache, value_cache, tables, [9, 30], 0.25),
                               atol=1e-5, rtol=1e-5)


def test_the_cpu_backend_is_the_default_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    assert select_backend(torch.device("cpu")) is cpu_ops
    assert select_backend(torch.device("cpu"), "torch") is reference
