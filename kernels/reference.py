"""Plain-torch paged attention and cache kernels: the CPU path and the oracle for Triton.

Cache layout (per layer): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's token at position ``p``
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot
is ``block * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import check_cache_write, check_copy, check_decode, check_prefill, check_swap


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their flat slots.

    A slot of -1 means "skip this token" (padding).
    """
    check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_key_cache = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_value_cache = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_context_blocks: int
) -> torch.Tensor:
    """Gather the first ``num_context_blocks`` blocks of each row of ``block_tables``.

    Returns ``[num_seqs, num_context_blocks * block_size, num_kv_heads, head_dim]``. Padding
    entries (block ids outside the cache) read a clamped block; callers mask those positions out.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    table = block_tables[:, :num_context_blocks].clamp(0, num_blocks - 1).to(torch.long)
    gathered = cache.index_select(0, table.reshape(-1))
    return gathered.view(table.shape[0], num_context_blocks * block_size, num_kv_heads, head_dim)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention over padded context.

    query ``[S, Q, H, D]``, key/value ``[S, L, KV, D]``, mask ``[S, Q, L]`` (True = attend).
    Math in fp32 (torch's fused SDPA); returns ``[S, Q, H, D]`` in the query's dtype.
    """
    out = F.scaled_dot_product_attention(
        query.float().transpose(1, 2),
        key.float().transpose(1, 2),
        value.float().transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).to(query.dtype)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence ``[num_seqs, num_heads, head_dim]`` against its paged context.

    ``block_tables`` is ``[num_seqs, max_blocks]`` (padded with any value past each context),
    ``context_lens`` ``[num_seqs]`` counts the tokens to attend to, the new one included.
    """
    max_context_len = check_decode(query, key_cache, value_cache, block_tables, context_lens)
    if query.shape[0] == 0:
        return torch.empty_like(query)
    block_size = key_cache.shape[1]
    num_context_blocks = (max_context_len + block_size - 1) // block_size
    key = gather_context(key_cache, block_tables, num_context_blocks)
    value = gather_context(value_cache, block_tables, num_context_blocks)
    positions = torch.arange(num_context_blocks * block_size, device=query.device)
    mask = (positions[None, :] < context_lens[:, None].to(positions.device))[:, None, :]
    return _attend(query[:, None], key, value, mask, scale)[:, 0]


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a flattened batch of new tokens against their paged context.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i + 1]``, which are the last tokens of its
    ``context_lens[i]`` tokens (their K/V already written into the cache). Token ``j`` of a
    sequence attends to every context position up to and including its own.
    """
    _, starts = check_prefill(
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens
    )
    block_size = key_cache.shape[1]
    lens = context_lens.tolist()
    num_queries = [end - start for start, end in zip(starts, starts[1:])]
    useful = sum(q * length for q, length in zip(num_queries, lens))
    if lens and len(lens) * max(num_queries) * max(lens) <= 2 * useful:
        return _prefill_padded(query, key_cache, value_cache, block_tables, starts, lens, scale)
    out = torch.empty_like(query)
    for i, context_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        num_context_blocks = (context_len + block_size - 1) // block_size
        table = block_tables[i : i + 1]
        key = gather_context(key_cache, table, num_context_blocks)
        value = gather_context(value_cache, table, num_context_blocks)
        key_positions = torch.arange(num_context_blocks * block_size, device=query.device)
        query_positions = torch.arange(context_len - num_queries, context_len, device=query.device)
        mask = (key_positions[None, :] <= query_positions[:, None])[None]
        out[start:end] = _attend(query[None, start:end], key, value, mask, scale)[0]
    return out


def _prefill_padded(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    lens: list[int],
    scale: float,
) -> torch.Tensor:
    """``paged_prefill_attention`` as one padded batch: used when sequences are of similar size,
    where one fused call beats a Python loop over sequences."""
    device = query.device
    block_size = key_cache.shape[1]
    num_context_blocks = (max(lens) + block_size - 1) // block_size
    key = gather_context(key_cache, block_tables, num_context_blocks)
    value = gather_context(value_cache, block_tables, num_context_blocks)
    first = torch.tensor(starts[:-1], device=device)
    num_queries = torch.tensor(starts[1:], device=device) - first
    offsets = torch.arange(int(num_queries.max()), device=device)
    valid = offsets[None, :] < num_queries[:, None]  # [S, Qmax]: real query rows
    rows = torch.where(valid, first[:, None] + offsets[None, :], 0)
    positions = torch.tensor(lens, device=device)[:, None] - num_queries[:, None] + offsets[None, :]
    key_positions = torch.arange(num_context_blocks * block_size, device=device)
    mask = (key_positions[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
    mask[:, :, 0] |= ~valid  # padding rows attend somewhere (their output is dropped), never NaN
    return _attend(query[rows], key, value, mask, scale)[valid]


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks ``src -> dst`` (rows of ``block_mapping [n, 2]``) in every layer."""
    check_copy(key_caches, value_caches, block_mapping)
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(torch.long)
    dst = block_mapping[:, 1].to(torch.long)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst.to(cache.device), cache.index_select(0, src.to(cache.device)))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks from one cache tensor to another (device <-> CPU): ``dst[d] = src[s]``."""
    check_swap(src, dst, block_mapping)
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].to(device=src.device, dtype=torch.long)
    dst_ids = block_mapping[:, 1].to(device=dst.device, dtype=torch.long)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))
