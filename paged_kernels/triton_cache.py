"""Triton kernels that write tokens into KV-cache slots and copy whole blocks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels.checks import check_cache_write, check_copy
from paged_kernels.launch import next_power_of_2

COPY_CHUNK = 1024  # cache elements copied per program


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_block,
    stride_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Write one token's K and V (all KV heads) into its slot; slot -1 is skipped."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_block
        + (slot % BLOCK_SIZE) * stride_slot
        + heads[:, None] * stride_kv_head
        + dims[None, :]
    )
    key_offsets = token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :]
    key = tl.load(key_ptr + key_offsets, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value_offsets = token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
    value = tl.load(value_ptr + value_offsets, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_range: tuple[int, int] | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their flat slots.

    ``slot_range`` (lowest, highest slot), known from host data, spares the check a device sync.
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping, slot_range)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )


@triton.jit
def _copy_blocks_kernel(
    key_cache_ptr,
    value_cache_ptr,
    block_mapping_ptr,
    stride_block,
    stride_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Copy one chunk of one (src, dst) block pair, in the key and the value cache."""
    pair = tl.program_id(0).to(tl.int64)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    elements = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = elements < BLOCK_NUMEL
    # Elements are numbered slot-major within a block; strides allow padded layouts.
    slots = elements // (NUM_KV_HEADS * HEAD_DIM)
    heads = (elements // HEAD_DIM) % NUM_KV_HEADS
    offsets = slots * stride_slot + heads * stride_kv_head + elements % HEAD_DIM
    key = tl.load(key_cache_ptr + src * stride_block + offsets, mask=mask)
    tl.store(key_cache_ptr + dst * stride_block + offsets, key, mask=mask)
    value = tl.load(value_cache_ptr + src * stride_block + offsets, mask=mask)
    tl.store(value_cache_ptr + dst * stride_block + offsets, value, mask=mask)


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks ``src -> dst`` (rows of ``block_mapping [n, 2]``) in every layer.

    One launch per layer copies keys and values; a block must not be both a source and a
    destination in one mapping (copy-on-write targets are always freshly allocated).
    """
    check_copy(key_caches, value_caches, block_mapping)
    if block_mapping.numel() == 0 or not key_caches:
        return
    _, block_size, num_kv_heads, head_dim = key_caches[0].shape
    block_numel = block_size * num_kv_heads * head_dim
    mapping = block_mapping.to(key_caches[0].device).contiguous()
    grid = (mapping.shape[0], triton.cdiv(block_numel, COPY_CHUNK))
    for key_cache, value_cache in zip(key_caches, value_caches):
        _copy_blocks_kernel[grid](
            key_cache, value_cache, mapping,
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_NUMEL=block_numel,
            CHUNK=COPY_CHUNK,
        )
