"""Argument checks shared by the kernel backends: fail with a ValueError before any launch.

Shape, dtype and device checks are free. Value checks (block ids, lengths, slots) read the
values: from ``HostTables`` when the caller has host copies (the engine always does), else from
the device in one sync per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class HostTables:
    """Host copies of the block tables and lengths a step's device tensors were made from."""

    block_tables: list[list[int]]  # each sequence's blocks, at least those its context uses
    context_lens: list[int]
    query_start_loc: list[int] | None = None  # prefill only


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """Raise ``ValueError(message)`` unless ``ok``; a formatted message comes as a callable, so that a check that
    passes formats nothing (the engine checks every layer's arguments on every step)."""
    if not ok:
        raise ValueError(message if isinstance(message, str) else message())


def _check_index(name: str, tensor: torch.Tensor, ndim: int, device: torch.device) -> None:
    """An integer index tensor of ``ndim`` dimensions on ``device``."""
    _require(tensor.dtype in INDEX_DTYPES, lambda: f"{name} must be int32 or int64, got {tensor.dtype}")
    _require(tensor.dim() == ndim, lambda: f"{name} must have {ndim} dimensions, got {tuple(tensor.shape)}")
    _require(tensor.device == device, lambda: f"{name} must be on {device}, got {tensor.device}")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Key and value caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, alike in all."""
    _require(key_cache.dim() == 4, lambda: f"key_cache must be 4-D, got {tuple(key_cache.shape)}")
    _require(
        value_cache.shape == key_cache.shape,
        lambda: f"value_cache shape {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}",
    )
    _require(key_cache.dtype in CACHE_DTYPES, lambda: f"key_cache dtype must be one of {CACHE_DTYPES}")
    _require(
        value_cache.dtype == key_cache.dtype,
        lambda: f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}",
    )
    _require(value_cache.device == key_cache.device, "value_cache must be on key_cache's device")
    _require(key_cache.stride(-1) == 1, "key_cache must be contiguous in head_dim")
    _require(
        value_cache.stride() == key_cache.stride(),
        lambda: f"value_cache strides {value_cache.stride()} != key_cache strides {key_cache.stride()}",
    )


def check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_range: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Arguments of ``reshape_and_cache``; slots must be -1 or inside the cache.

    ``slot_range`` bounds the slots from host data (no device sync); returns the range checked.
    """
    check_cache_pair(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    expected = (key.shape[0], num_kv_heads, head_dim)
    _require(tuple(key.shape) == expected, lambda: f"key must be {expected}, got {tuple(key.shape)}")
    _require(value.shape == key.shape, lambda: f"value shape {tuple(value.shape)} != key shape")
    _require(value.dtype == key.dtype, lambda: f"value dtype {value.dtype} != key dtype {key.dtype}")
    _require(key.stride(-1) == 1, "key must be contiguous in head_dim")
    _require(value.stride(-1) == 1, "value must be contiguous in head_dim")
    _require(key.device == key_cache.device, "key must be on the cache's device")
    _require(value.device == key_cache.device, "value must be on the cache's device")
    _check_index("slot_mapping", slot_mapping, 1, key_cache.device)
    _require(
        slot_mapping.shape[0] == key.shape[0],
        lambda: f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens",
    )
    if not slot_mapping.numel():
        return 0, 0
    if slot_range is None:
        slot_range = tuple(torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist())
    low, high = slot_range
    num_slots = num_blocks * block_size
    _require(
        low >= -1 and high < num_slots,
        lambda: f"slot_mapping must be -1 or in [0, {num_slots}), got values in [{low}, {high}]",
    )
    return low, high


def _check_query(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """``query [tokens, num_heads, head_dim]`` matching the cache's head_dim and KV heads."""
    head_dim, num_kv_heads = key_cache.shape[3], key_cache.shape[2]
    _require(query.dim() == 3, lambda: f"query must be [tokens, heads, head_dim], got {tuple(query.shape)}")
    _require(query.dtype in CACHE_DTYPES, lambda: f"query dtype must be one of {CACHE_DTYPES}")
    _require(query.shape[2] == head_dim, lambda: f"query head_dim {query.shape[2]} != cache's {head_dim}")
    _require(
        query.shape[1] % num_kv_heads == 0,
        lambda: f"num_heads {query.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}",
    )
    _require(query.device == key_cache.device, "query must be on the cache's device")
    _require(query.stride(-1) == 1, "query must be contiguous in head_dim")


def _fetch(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    """The values of small integer/bool tensors as one flat list, in one device sync."""
    if not tensors:
        return []
    return torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).tolist()


def _check_table_shapes(
    key_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, num_seqs: int
) -> None:
    """Block tables ``[num_seqs, max_blocks]`` and context lengths ``[num_seqs]``."""
    _check_index("block_tables", block_tables, 2, key_cache.device)
    _check_index("context_lens", context_lens, 1, key_cache.device)
    _require(
        block_tables.shape[0] == num_seqs,
        lambda: f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    _require(
        context_lens.shape[0] == num_seqs,
        lambda: f"context_lens has {context_lens.shape[0]} entries for {num_seqs} sequences",
    )


def _check_table_values(
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    extra: tuple[torch.Tensor, ...] = (),
) -> list[int]:
    """Context lengths within the tables, blocks in use inside the cache; returns the longest
    context length followed by the values of ``extra``, all fetched in one device sync."""
    if context_lens.numel() == 0:
        return [0, *_fetch(extra)]
    num_blocks, block_size = key_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    # Only the blocks a context uses must be valid; the rest of a row is padding.
    blocks_in_use = torch.div(context_lens + block_size - 1, block_size, rounding_mode="floor")
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    in_use = columns[None, :] < blocks_in_use[:, None]
    bad_block = (in_use & ((block_tables < 0) | (block_tables >= num_blocks))).any()
    stats = (context_lens.min(), context_lens.max(), bad_block, *extra)
    values = _fetch(stats)
    low, high, bad = values[:3]
    _require(low >= 1, lambda: f"context_lens must be >= 1, got {low}")
    _require(
        high <= capacity,
        lambda: f"context_lens must be <= block_tables capacity of {capacity} tokens, got {high}",
    )
    _require(
        not bad,
        lambda: f"block_tables point past the cache: blocks in use must be in [0, {num_blocks})",
    )
    return [high, *values[3:]]


def check_host_tables(key_cache: torch.Tensor, block_tables: torch.Tensor, host: HostTables) -> int:
    """``_check_table_values`` on host copies: no device sync. Returns the longest context length."""
    lens = host.context_lens
    _require(
        len(lens) == len(host.block_tables) == block_tables.shape[0],
        lambda: f"host copies hold {len(lens)} context_lens and {len(host.block_tables)} tables "
        f"for {block_tables.shape[0]} block_tables rows",
    )
    if not lens:
        return 0
    num_blocks, block_size = key_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    low, high = min(lens), max(lens)
    _require(low >= 1, lambda: f"context_lens must be >= 1, got {low}")
    _require(
        high <= capacity,
        lambda: f"context_lens must be <= block_tables capacity of {capacity} tokens, got {high}",
    )
    # Only the blocks a context uses must be valid; the rest of a row is padding.
    blocks_in_use = [(n + block_size - 1) // block_size for n in lens]
    in_use = [block for row, count in zip(host.block_tables, blocks_in_use) for block in row[:count]]
    _require(
        len(in_use) == sum(blocks_in_use) and min(in_use) >= 0 and max(in_use) < num_blocks,
        lambda: f"block_tables point past the cache: blocks in use must be in [0, {num_blocks})",
    )
    return high


def check_attention_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The shape, dtype and device checks of an attention call (no device sync)."""
    check_cache_pair(key_cache, value_cache)
    _check_query(query, key_cache)


def check_decode_shapes(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
) -> None:
    """The shape, dtype and device checks of ``paged_attention_decode`` (no values read)."""
    check_attention_inputs(query, key_cache, value_cache)
    _check_table_shapes(key_cache, block_tables, context_lens, query.shape[0])


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    host: HostTables | None = None,
) -> int:
    """Arguments of ``paged_attention_decode``; returns the longest context length.

    Values are read from ``host`` when given, else from the device (one sync)."""
    check_decode_shapes(query, key_cache, value_cache, block_tables, context_lens)
    if host is not None:
        return check_host_tables(key_cache, block_tables, host)
    return _check_table_values(key_cache, block_tables, context_lens)[0]


def check_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    host: HostTables | None = None,
) -> tuple[int, list[int]]:
    """Arguments of ``paged_prefill_attention``; returns (longest context, query_start_loc).

    Values are read from ``host`` (with its ``query_start_loc``) when given, else from the device
    (one sync)."""
    check_attention_inputs(query, key_cache, value_cache)
    _check_index("query_start_loc", query_start_loc, 1, key_cache.device)
    num_seqs = query_start_loc.shape[0] - 1
    _require(num_seqs >= 0, "query_start_loc must hold num_seqs + 1 offsets")
    _check_table_shapes(key_cache, block_tables, context_lens, num_seqs)
    if host is not None:
        _require(
            host.query_start_loc is not None and len(host.query_start_loc) == num_seqs + 1,
            lambda: f"host copies of a prefill need query_start_loc of {num_seqs + 1} offsets",
        )
        max_context_len, starts = check_host_tables(key_cache, block_tables, host), host.query_start_loc
        too_many_queries = any(
            end - start > n for start, end, n in zip(starts, starts[1:], host.context_lens)
        )
    else:
        num_queries = query_start_loc[1:] - query_start_loc[:-1]
        too_many = (num_queries > context_lens).any()
        max_context_len, too_many_queries, *starts = _check_table_values(
            key_cache, block_tables, context_lens, (too_many, query_start_loc)
        )
    _require(
        starts[0] == 0 and starts[-1] == query.shape[0] and starts == sorted(starts),
        lambda: f"query_start_loc must rise from 0 to {query.shape[0]}, got {starts}",
    )
    _require(not too_many_queries, "each sequence's query count must be <= its context_lens entry")
    return max_context_len, starts


def _check_block_ids(name: str, ids: torch.Tensor, num_blocks: int) -> None:
    """Block ids of one side of a block mapping lie in ``[0, num_blocks)``."""
    low, high = torch.stack([ids.min(), ids.max()]).tolist()
    _require(
        low >= 0 and high < num_blocks,
        lambda: f"{name} block ids must be in [0, {num_blocks}), got values in [{low}, {high}]",
    )


def _check_mapping(block_mapping: torch.Tensor) -> None:
    """A ``[n, 2]`` integer block mapping of (src, dst) pairs."""
    _require(block_mapping.dtype in INDEX_DTYPES, "block_mapping must be int32 or int64")
    _require(
        block_mapping.dim() == 2 and block_mapping.shape[1] == 2,
        lambda: f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}",
    )


def check_copy(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Arguments of ``copy_blocks``: one key and one value cache per layer, ids in range."""
    _require(
        len(key_caches) == len(value_caches),
        lambda: f"{len(key_caches)} key_caches but {len(value_caches)} value_caches",
    )
    _check_mapping(block_mapping)
    for key_cache, value_cache in zip(key_caches, value_caches):
        check_cache_pair(key_cache, value_cache)
        _require(key_cache.shape == key_caches[0].shape, "all layers' caches must share one shape")
    if key_caches and block_mapping.numel():
        _check_block_ids("block_mapping", block_mapping, key_caches[0].shape[0])


def check_swap(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Arguments of ``swap_blocks``: same block shape and dtype, ids in range on each side."""
    _require(
        src.shape[1:] == dst.shape[1:],
        lambda: f"src block shape {tuple(src.shape[1:])} != dst {tuple(dst.shape[1:])}",
    )
    _require(src.dtype == dst.dtype, lambda: f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    _check_mapping(block_mapping)
    if block_mapping.numel():
        _check_block_ids("block_mapping[:, 0] (src)", block_mapping[:, 0], src.shape[0])
        _check_block_ids("block_mapping[:, 1] (dst)", block_mapping[:, 1], dst.shape[0])
