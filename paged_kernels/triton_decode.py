"""Paged attention for decode: one new query token per sequence, flash-decoding style.

Each program handles one (sequence, KV head, partition of context positions) and all query
heads of that KV head's group at once, so GQA/MQA read every key once. The number of partitions
per sequence is chosen per step from the SM count (``paged_kernels.launch.choose_decode_split``) and
passed as plain arguments; each program derives its partition's length from its sequence's context
on the device (``partition_length``). Launch sizes come from host values only, no size is a
compile-time constant that would recompile the kernels as contexts grow, and a grid planned for the
block tables' capacity (``plan_decode_static``, which a CUDA graph replays) still splits short
contexts across the GPU. A plan of one partition writes the output directly; otherwise each program
writes a partial result that a second kernel merges, so a few sequences still fill the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_kernels.checks import HostTables, check_attention_inputs, check_decode, check_decode_shapes
from paged_kernels.launch import (
    DEEP_PARTITION_TOKENS,
    MAX_PARTITION_TOKENS,
    MIN_DOT_ROWS,
    MIN_PARTITION_TOKENS,
    LaunchConfig,
    choose_decode_split,
    choose_launch,
    device_limits,
    next_power_of_2,
    tile_tokens,
)
from paged_kernels.triton_tiles import LOG2_E, attend_tile, dot_dtype, dot_precision

# Host values that change from step to step: Triton would otherwise compile a variant for each that is 1 or a
# multiple of 16 (its integer specialisation), i.e. compile in the middle of serving.
SPLIT_ARGUMENTS = ["num_partitions", "fill_partitions", "deep_partitions", "max_partition_tokens"]
REDUCE_CHUNK = 16  # partition results the merge kernel reads per loop iteration


@triton.jit
def partition_length(
    context_len, fill_partitions, deep_partitions, max_tokens,
    TILE: tl.constexpr, MIN_TOKENS: tl.constexpr, DEEP_TOKENS: tl.constexpr,
):
    """Context positions per partition of a sequence, the split ``launch.choose_decode_split`` would choose for
    this context alone: ``fill_partitions`` ways, fewer where a part would be shorter than ``MIN_TOKENS``, or
    ``deep_partitions`` ways, fewer where a part would be shorter than ``DEEP_TOKENS``, whichever is more; more
    where a part would be longer than ``max_tokens`` (all multiples of ``TILE``); an equal share in whole tiles,
    at least ``MIN_TOKENS``. The last partitions may hold nothing."""
    spread = tl.minimum(fill_partitions, tl.cdiv(context_len, MIN_TOKENS))
    deep = tl.minimum(deep_partitions, context_len // DEEP_TOKENS)
    parts = tl.maximum(tl.cdiv(context_len, max_tokens), tl.maximum(spread, deep))
    share = tl.cdiv(tl.cdiv(context_len, parts), TILE) * TILE
    return tl.maximum(share, MIN_TOKENS)


@triton.jit(do_not_specialize=["stride_table_seq", *SPLIT_ARGUMENTS])
def _decode_partition_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    stride_query_seq,
    stride_query_head,
    stride_out_seq,
    stride_out_head,
    stride_block,
    stride_slot,
    stride_kv_head,
    stride_table_seq,
    num_heads,
    num_partitions,
    fill_partitions,
    deep_partitions,
    max_partition_tokens,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    MIN_PARTITION: tl.constexpr,
    DEEP_PARTITION: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attention of one head group over one context partition."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    tokens = partition_length(context_len, fill_partitions, deep_partitions, max_partition_tokens, TILE,
                              MIN_PARTITION, DEEP_PARTITION)
    start = partition * tokens
    if start >= context_len:
        return
    end = tl.minimum(start + tokens, context_len)

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_offsets = seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :]
    query = tl.load(query_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    query = query.to(DOT_DTYPE)

    table_row_ptr = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_kv_head
    max_score = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    score_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        score_mask = tl.broadcast_to(valid[None, :], (GROUP_PAD, TILE))
        max_score, score_sum, acc = attend_tile(
            query, key_cache_ptr, value_cache_ptr, table_row_ptr, positions, valid, score_mask,
            head_offset, dims, dim_mask, max_score, score_sum, acc, qk_scale,
            stride_block, stride_slot, BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION,
        )

    store_mask = row_mask[:, None] & dim_mask[None, :]
    if SINGLE_PARTITION:
        out = acc / score_sum[:, None]
        out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        slot = (seq * num_heads + heads) * num_partitions + partition
        tl.store(partial_max_ptr + slot, max_score, mask=row_mask)
        tl.store(partial_sum_ptr + slot, score_sum, mask=row_mask)
        partial_offsets = slot[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(partial_out_ptr + partial_offsets, acc, mask=row_mask[:, None])


@triton.jit(do_not_specialize=SPLIT_ARGUMENTS)
def _decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    context_lens_ptr,
    stride_out_seq,
    stride_out_head,
    num_heads,
    num_partitions,
    fill_partitions,
    deep_partitions,
    max_partition_tokens,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    MIN_PARTITION: tl.constexpr,
    DEEP_PARTITION: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Merge one head's partition results, ``CHUNK`` at a time: rescale each to the running max
    score, sum, then normalise."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq)
    tokens = partition_length(context_len, fill_partitions, deep_partitions, max_partition_tokens, TILE,
                              MIN_PARTITION, DEEP_PARTITION)
    used_partitions = tl.cdiv(context_len, tokens)
    first_slot = (seq * num_heads + head) * num_partitions
    dims = tl.arange(0, HEAD_DIM_PAD)
    max_score = float("-inf")  # fp32 scalars once carried through the loop (as SGLang's merge)
    total = 0.0
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for chunk_start in range(0, used_partitions, CHUNK):
        partitions = chunk_start + tl.arange(0, CHUNK)
        used = partitions < used_partitions
        slots = first_slot + partitions
        max_scores = tl.load(partial_max_ptr + slots, mask=used, other=float("-inf"))
        # partition 0 is always used, so the running max is finite from the first chunk on
        new_max = tl.maximum(max_score, tl.max(max_scores, axis=0))
        rescale = tl.exp2(max_score - new_max)
        weights = tl.exp2(max_scores - new_max)
        sums = tl.load(partial_sum_ptr + slots, mask=used, other=0.0)
        partial = tl.load(
            partial_out_ptr + slots[:, None] * HEAD_DIM_PAD + dims[None, :], mask=used[:, None], other=0.0
        )
        total = total * rescale + tl.sum(weights * sums, axis=0)
        acc = acc * rescale + tl.sum(partial * weights[:, None], axis=0)
        max_score = new_max
    out_offsets = seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, (acc / total).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """A checked decode launch, made from host values once and reused by every layer of a step."""

    max_context_len: int  # the longest context the plan was made for
    num_partitions: int  # per sequence at most: the grid's third axis
    fill_partitions: int  # per sequence where its context allows: the two ways of launch.DecodeSplit
    deep_partitions: int
    max_partition_tokens: int
    tile_tokens: int
    group_rows: int  # query heads of one KV head, padded for tl.dot
    launch: LaunchConfig

    def __post_init__(self) -> None:
        """Refuse counts under which a sequence could split into more partitions than the grid has: its kernels
        would write and read past their partial results (a plan edited with ``dataclasses.replace``, say)."""
        for name in ("fill_partitions", "deep_partitions"):
            if not 1 <= getattr(self, name) <= self.num_partitions:
                raise ValueError(f"{name} must be 1 to num_partitions ({self.num_partitions}), "
                                 f"got {getattr(self, name)}")
        if self.max_partition_tokens < 1 or self.num_partitions * self.max_partition_tokens < self.max_context_len:
            raise ValueError(f"num_partitions x max_partition_tokens ({self.num_partitions} x "
                             f"{self.max_partition_tokens}) must hold max_context_len ({self.max_context_len})")


def plan_decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, host: HostTables | None = None,
) -> DecodePlan:
    """Check the arguments of ``paged_attention_decode`` and choose its launch for the device.

    ``host`` holds host copies of the tables and lengths: planning from them reads nothing back."""
    max_context_len = check_decode(query, key_cache, value_cache, block_tables, context_lens, host)
    return _plan(query, key_cache, max_context_len)


def plan_decode_static(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
) -> DecodePlan:
    """A plan that holds for any values these tensors may hold later (blocks inside the cache, contexts
    of 1 up to the tables' capacity): its grid comes from the capacity (``block_tables`` columns x block
    size), never from the lengths, so a CUDA graph captured with it stays right as contexts grow.
    Checks shapes only; partitions past a sequence's context return at once."""
    check_decode_shapes(query, key_cache, value_cache, block_tables, context_lens)
    return _plan(query, key_cache, block_tables.shape[1] * key_cache.shape[1])


def _plan(query: torch.Tensor, key_cache: torch.Tensor, max_context_len: int) -> DecodePlan:
    """The launch for contexts of up to ``max_context_len`` tokens."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    limits = device_limits(query.device)
    head_dim_pad, element_bytes = next_power_of_2(head_dim), key_cache.element_size()
    tile = tile_tokens(head_dim_pad, element_bytes)
    group_rows = max(MIN_DOT_ROWS, next_power_of_2(num_heads // num_kv_heads))
    split = choose_decode_split(num_seqs, num_kv_heads, max_context_len, limits)
    return DecodePlan(
        max_context_len,
        split.partitions,
        split.fill,
        split.deep,
        MAX_PARTITION_TOKENS,
        tile,
        group_rows,
        choose_launch(group_rows, tile, head_dim_pad, element_bytes, limits.shared_memory_bytes),
    )


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query token per sequence ``[num_seqs, num_heads, head_dim]`` against its context.

    ``plan`` is ``plan_decode`` of these same arguments, when several layers share the tables:
    it saves each layer the checks and a device sync.
    """
    if plan is None:
        plan = plan_decode(query, key_cache, value_cache, block_tables, context_lens)
    else:
        check_attention_inputs(query, key_cache, value_cache)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    head_dim_pad = next_power_of_2(head_dim)
    num_partitions = plan.num_partitions
    single = num_partitions == 1
    partial_shape = (num_seqs, num_heads, num_partitions) if not single else (0,)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    partial_out = torch.empty((*partial_shape, head_dim_pad), dtype=torch.float32, device=query.device)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, partial_out, partial_max, partial_sum,
        query, key_cache, value_cache, block_tables, context_lens,
        scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        num_heads, num_partitions, plan.fill_partitions, plan.deep_partitions, plan.max_partition_tokens,
        GROUP=num_heads // num_kv_heads,
        GROUP_PAD=plan.group_rows,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=plan.tile_tokens,
        MIN_PARTITION=MIN_PARTITION_TOKENS,
        DEEP_PARTITION=DEEP_PARTITION_TOKENS,
        SINGLE_PARTITION=single,
        DOT_DTYPE=dot_dtype(key_cache.dtype),
        DOT_PRECISION=dot_precision(key_cache.dtype),
        num_warps=plan.launch.num_warps,
        num_stages=plan.launch.num_stages,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_max, partial_sum, context_lens,
            out.stride(0), out.stride(1), num_heads, num_partitions, plan.fill_partitions, plan.deep_partitions,
            plan.max_partition_tokens,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            TILE=plan.tile_tokens,
            MIN_PARTITION=MIN_PARTITION_TOKENS,
            DEEP_PARTITION=DEEP_PARTITION_TOKENS,
            CHUNK=REDUCE_CHUNK,
        )
    return out
