"""Paged attention for prefill: a flattened batch of new tokens against their paged context.

Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]``; they are the last
tokens of its ``context_lens[i]`` (already written into the cache), so cached prefixes and
chunked prefill need no separate path. Each program handles a run of query tokens of one
sequence for all query heads that share one KV head (GQA), so each K/V tile is read once per
group, and walks the context only up to its last token's position (causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_kernels.checks import HostTables, check_attention_inputs, check_prefill
from paged_kernels.launch import PrefillTiles, choose_prefill_tiles, device_limits, next_power_of_2
from paged_kernels.triton_tiles import LOG2_E, attend_tile, dot_dtype, dot_precision


# the tables' width changes from step to step: no variant per width that is 1 or a multiple of 16
@triton.jit(do_not_specialize=["stride_table_seq"])
def _prefill_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    qk_scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_block,
    stride_slot,
    stride_kv_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    TOKENS: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Causal attention of ``TOKENS`` query tokens of one sequence, all heads of one KV group.

    Row ``r`` of the ``BLOCK_ROWS`` rows is token ``r // GROUP`` and head ``r % GROUP`` of the
    group: every key and value tile is loaded once for the whole group.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    first_token = tl.program_id(2) * TOKENS
    query_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    num_queries = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - query_start
    if first_token >= num_queries:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
    rows = tl.arange(0, BLOCK_ROWS)
    token_offsets = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TOKENS * GROUP) & (token_offsets < num_queries)
    # Padding rows get positions past the context and are never stored.
    query_positions = context_len - num_queries + token_offsets
    end = tl.minimum(context_len, context_len - num_queries + first_token + TOKENS)

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    tokens = query_start + token_offsets
    q_offsets = tokens[:, None] * stride_query_token + heads[:, None] * stride_query_head + dims[None, :]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    query = tl.load(query_ptr + q_offsets, mask=io_mask, other=0.0)
    query = query.to(DOT_DTYPE)

    table_row_ptr = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_kv_head
    max_score = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    score_sum = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(0, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        score_mask = valid[None, :] & (positions[None, :] <= query_positions[:, None])
        max_score, score_sum, acc = attend_tile(
            query, key_cache_ptr, value_cache_ptr, table_row_ptr, positions, valid, score_mask,
            head_offset, dims, dim_mask, max_score, score_sum, acc, qk_scale,
            stride_block, stride_slot, BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION,
        )

    out = acc / score_sum[:, None]
    out_offsets = tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """A checked prefill launch, made from host values once and reused by every layer of a step."""

    query_start_loc: list[int]
    max_queries: int  # the longest run of new tokens of one sequence
    tiles: PrefillTiles


def plan_prefill(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    host: HostTables | None = None,
) -> PrefillPlan:
    """Check the arguments of ``paged_prefill_attention`` and choose its tiles for the device.

    ``host`` holds host copies of the tables and offsets: planning from them reads nothing back."""
    _, starts = check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, host)
    group = query.shape[1] // key_cache.shape[2]
    max_queries = max((end - start for start, end in zip(starts, starts[1:])), default=0)
    tiles = choose_prefill_tiles(
        group, next_power_of_2(query.shape[2]), key_cache.element_size(), max_queries, device_limits(query.device)
    )
    return PrefillPlan(starts, max_queries, tiles)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: PrefillPlan | None = None,
) -> torch.Tensor:
    """Causal attention for a flattened batch of new tokens against their paged context.

    ``plan`` is ``plan_prefill`` of these same arguments, when several layers share them.
    """
    if plan is None:
        plan = plan_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    else:
        check_attention_inputs(query, key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.max_queries == 0:
        return out
    tiles = plan.tiles
    grid = (len(plan.query_start_loc) - 1, num_kv_heads, triton.cdiv(plan.max_queries, tiles.tokens))
    _prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
        scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_ROWS=tiles.rows,
        TOKENS=tiles.tokens,
        TILE=tiles.tile_tokens,
        DOT_DTYPE=dot_dtype(key_cache.dtype),
        DOT_PRECISION=dot_precision(key_cache.dtype),
        num_warps=tiles.launch.num_warps,
        num_stages=tiles.launch.num_stages,
    )
    return out
