"""Triton building blocks shared by the paged attention kernels.

A "tile" is ``TILE`` consecutive context positions of one sequence. Each position is looked
up in the block table on its own, so a tile may span several cache blocks and any block size
works with any tile size. All cache offsets are computed in int64: a cache of more than 2^31
elements is normal on a large GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches get exact fp32 dots (no TF32 rounding), 16-bit caches use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``), which compiles nothing."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand type of the attention dots: the cache's own, except bf16 in the interpreter.

    Triton's CPU interpreter (3.9) stores bf16 as raw uint16 and multiplies the bits in
    ``tl.dot``; there the operands are widened to fp32 instead.
    """
    if dtype == torch.bfloat16 and interpreted():
        return tl.float32
    return TL_DTYPES[dtype]


@triton.jit
def load_tile(
    cache_ptr,
    table_row_ptr,
    positions,
    valid,
    head_offset,
    dims,
    dim_mask,
    stride_block,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
):
    """Load ``[TILE, HEAD_DIM_PAD]`` cache rows of one KV head at context ``positions``."""
    blocks = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slots = (positions % BLOCK_SIZE).to(tl.int64)
    rows = blocks * stride_block + slots * stride_slot + head_offset
    mask = valid[:, None] & dim_mask[None, :]
    return tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def attend_tile(
    query,
    key_cache_ptr,
    value_cache_ptr,
    table_row_ptr,
    positions,
    valid,
    score_mask,
    head_offset,
    dims,
    dim_mask,
    max_score,
    score_sum,
    acc,
    qk_scale,
    stride_block,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step (base 2) of ``query [M, D]`` over a tile of paged context.

    ``score_mask [M, TILE]`` selects the pairs that may attend; every row must have seen at
    least one unmasked position by the end of its first tile, so ``max_score`` stays finite.
    """
    key = load_tile(
        key_cache_ptr, table_row_ptr, positions, valid, head_offset, dims, dim_mask,
        stride_block, stride_slot, BLOCK_SIZE,
    )
    key = key.to(DOT_DTYPE)
    scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * qk_scale
    scores = tl.where(score_mask, scores, float("-inf"))
    new_max = tl.maximum(max_score, tl.max(scores, axis=1))
    rescale = tl.exp2(max_score - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    value = load_tile(
        value_cache_ptr, table_row_ptr, positions, valid, head_offset, dims, dim_mask,
        stride_block, stride_slot, BLOCK_SIZE,
    )
    pv = tl.dot(probs.to(DOT_DTYPE), value.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    acc = acc * rescale[:, None] + pv
    score_sum = score_sum * rescale + tl.sum(probs, axis=1)
    return new_max, score_sum, acc
