"""Plain-torch paged attention and cache kernels: the CPU path and the oracle for Triton.

Cache layout (per layer): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's token at position ``p``
lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot
is ``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from paged_kernels.checks import (
    HostTables,
    check_attention_inputs,
    check_cache_write,
    check_copy,
    check_decode,
    check_decode_shapes,
    check_prefill,
    check_swap,
)
from paged_kernels.cpu_features import has_amx_for


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_range: tuple[int, int] | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their flat slots.

    A slot of -1 means "skip this token" (padding). ``slot_range`` (lowest, highest slot), known
    from host data, spares the check a device sync.
    """
    low, _ = check_cache_write(key, value, key_cache, value_cache, slot_mapping, slot_range)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if low < 0:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_key_cache = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_value_cache = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


# decode sequences are grouped by context length: a group's padded area may reach this multiple
# of its real context, and there are at most this many groups (each is one call per layer)
DECODE_PADDING_SLACK = 1.3
MAX_DECODE_GROUPS = 4


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended in one SDPA call: query rows padded to one width, context to one length."""

    block_ids: torch.Tensor  # [G * num_context_blocks] cache blocks to gather, clamped into the cache
    rows: torch.Tensor  # [G, Q] query rows; padding entries repeat row 0 and are dropped
    valid: torch.Tensor | None  # [G, Q] real query rows, None when every entry is real
    # [G, 1, Q, L] True = attend; None where every sequence's new tokens are its whole context: each query row then
    # attends the first Q keys causally, and SDPA's own causal path skips the blocks above the diagonal (a
    # 2,048-token prompt's attention took 0.54x its time with the mask, fp32 on a Zen 4)
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one step's paged attention runs, worked out once and reused by every layer.

    The groups partition the query rows; their outputs concatenate into the result, in query
    order unless ``row_order`` gives each output row's query row.
    """

    num_queries: int
    groups: tuple[AttentionGroup, ...]
    row_order: torch.Tensor | None = None


def _context_block_ids(cache_shape: torch.Size, block_tables: torch.Tensor, num_context_blocks: int) -> torch.Tensor:
    """The first ``num_context_blocks`` entries of each table row, flat, clamped into the cache
    (padding entries read some block; the mask hides it)."""
    table = block_tables[:, :num_context_blocks].clamp(0, cache_shape[0] - 1)
    return table.reshape(-1).to(torch.long)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``[num_seqs, context, num_kv_heads, head_dim]`` from ``num_seqs`` equal runs of ``block_ids``."""
    num_kv_heads, head_dim = cache.shape[2:]
    return cache.index_select(0, block_ids).view(num_seqs, -1, num_kv_heads, head_dim)


def plan_decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, host: HostTables | None = None,
) -> AttentionPlan:
    """Check the arguments of ``paged_attention_decode`` and plan it: one query row per sequence,
    sequences grouped by context length so that padding to each group's longest stays small.
    Layers that share the tables reuse the plan; ``host`` copies spare the device reads."""
    check_decode(query, key_cache, value_cache, block_tables, context_lens, host)
    if query.shape[0] == 0:
        return AttentionPlan(0, ())
    lens = host.context_lens if host is not None else context_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    # rows stay in query order inside a group, so a single group needs no reordering
    members = [sorted(group) for group in _length_groups(order, lens)]
    groups = tuple(
        _decode_group(key_cache.shape, block_tables, context_lens, rows, max(lens[i] for i in rows))
        for rows in members
    )
    row_order = [row for rows in members for row in rows]
    in_order = row_order == list(range(len(lens)))
    return AttentionPlan(query.shape[0], groups, None if in_order else torch.tensor(row_order, device=query.device))


def plan_decode_static(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor,
) -> None:
    """No plan holds for every value here (a plan is the gather of the step's blocks): ``None``, so each
    ``paged_attention_decode`` plans from the tensors' values, reading them back. Fine on the CPU, which
    never captures a CUDA graph; this backend cannot run in one."""
    check_decode_shapes(query, key_cache, value_cache, block_tables, context_lens)


def _length_groups(order: list[int], lens: list[int]) -> list[list[int]]:
    """Split sequences sorted by falling length into at most ``MAX_DECODE_GROUPS`` runs whose
    padded area (count × longest) stays within ``DECODE_PADDING_SLACK`` × their real lengths."""
    groups: list[list[int]] = [[]]
    total = 0
    for index in order:
        group = groups[-1]
        if group and (len(group) + 1) * lens[group[0]] > DECODE_PADDING_SLACK * (total + lens[index]) \
                and len(groups) < MAX_DECODE_GROUPS:
            groups.append([])
            group, total = groups[-1], 0
        group.append(index)
        total += lens[index]
    return groups


def _decode_group(
    cache_shape: torch.Size, block_tables: torch.Tensor, context_lens: torch.Tensor, members: list[int], longest: int,
) -> AttentionGroup:
    """Decode rows ``members`` against their contexts, padded to ``longest`` tokens."""
    device = block_tables.device
    block_size = cache_shape[1]
    num_context_blocks = (longest + block_size - 1) // block_size
    rows = torch.tensor(members, device=device)
    positions = torch.arange(num_context_blocks * block_size, device=device)
    mask = positions[None, :] < context_lens[rows][:, None]
    block_ids = _context_block_ids(cache_shape, block_tables[rows], num_context_blocks)
    return AttentionGroup(block_ids, rows[:, None], None, mask[:, None, None, :])


def plan_prefill(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
    host: HostTables | None = None,
) -> AttentionPlan:
    """Check the arguments of ``paged_prefill_attention`` and plan it: one padded group when the
    sequences are of similar size (one fused call beats a Python loop), else one group per sequence.
    ``host`` copies spare the device reads."""
    _, starts = check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, host)
    lens = host.context_lens if host is not None else context_lens.tolist()
    num_queries = [end - start for start, end in zip(starts, starts[1:])]
    useful = sum(q * length for q, length in zip(num_queries, lens))
    if lens and len(lens) * max(num_queries) * max(lens) <= 2 * useful:
        groups = (_padded_group(key_cache.shape, block_tables, starts, lens),)
    else:
        groups = tuple(
            _sequence_group(key_cache.shape, block_tables[i : i + 1], starts[i], starts[i + 1], length)
            for i, length in enumerate(lens) if starts[i + 1] > starts[i]
        )
    return AttentionPlan(starts[-1] if starts else 0, groups)


def _sequence_group(
    cache_shape: torch.Size, table: torch.Tensor, start: int, end: int, context_len: int
) -> AttentionGroup:
    """One sequence's new tokens ``start:end`` (the last of its ``context_len``), causally masked."""
    device = table.device
    block_size = cache_shape[1]
    num_context_blocks = (context_len + block_size - 1) // block_size
    rows = torch.arange(start, end, device=device)[None]
    block_ids = _context_block_ids(cache_shape, table, num_context_blocks)
    if context_len == end - start:  # a whole prompt
        return AttentionGroup(block_ids, rows, None, None)
    key_positions = torch.arange(num_context_blocks * block_size, device=device)
    query_positions = torch.arange(context_len - (end - start), context_len, device=device)
    mask = key_positions[None, :] <= query_positions[:, None]
    return AttentionGroup(block_ids, rows, None, mask[None, None])


def _padded_group(
    cache_shape: torch.Size, block_tables: torch.Tensor, starts: list[int], lens: list[int]
) -> AttentionGroup:
    """Every sequence in one group, query rows padded to the longest run of new tokens."""
    device = block_tables.device
    block_size = cache_shape[1]
    num_context_blocks = (max(lens) + block_size - 1) // block_size
    first = torch.tensor(starts[:-1], device=device)
    num_queries = torch.tensor(starts[1:], device=device) - first
    offsets = torch.arange(max(b - a for a, b in zip(starts, starts[1:])), device=device)
    valid = offsets[None, :] < num_queries[:, None]  # [S, Qmax]: real query rows
    rows = torch.where(valid, first[:, None] + offsets[None, :], 0)
    block_ids = _context_block_ids(cache_shape, block_tables, num_context_blocks)
    if all(end - start == length for start, end, length in zip(starts, starts[1:], lens)):
        # whole prompts: each query row attends the keys up to its own, all of them its sequence's (padding rows
        # too, whose outputs are dropped)
        return AttentionGroup(block_ids, rows, valid, None)
    positions = torch.tensor(lens, device=device)[:, None] - num_queries[:, None] + offsets[None, :]
    key_positions = torch.arange(num_context_blocks * block_size, device=device)
    mask = (key_positions[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
    mask[:, :, 0] |= ~valid  # padding rows attend somewhere (their output is dropped), never NaN
    return AttentionGroup(block_ids, rows, valid, mask[:, None])


def _attend_planned(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: AttentionPlan, scale: float,
) -> torch.Tensor:
    """Run ``plan``'s groups: gather each group's context, one SDPA call each."""
    if plan.num_queries != query.shape[0]:
        raise ValueError(f"plan covers {plan.num_queries} query rows, query has {query.shape[0]}")
    if not plan.groups:
        return torch.empty_like(query)
    outputs = []
    for group in plan.groups:
        num_seqs = group.rows.shape[0]
        key = _gather(key_cache, group.block_ids, num_seqs)
        value = _gather(value_cache, group.block_ids, num_seqs)
        if group.mask is None:  # causal over the first Q keys
            width = group.rows.shape[1]
            key, value = key[:, :width], value[:, :width]
        out = _attend(query[group.rows], key, value, group.mask, scale)
        outputs.append(out.flatten(0, 1) if group.valid is None else out[group.valid])
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if plan.row_order is None:
        return out
    return torch.empty_like(out).index_copy_(0, plan.row_order, out)


def _math_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention runs in: the inputs' own where the CPU has AMX tiles for it (torch's fused CPU SDPA
    then multiplies in tiles: 4.7x faster than converting, at 32 decodes of 208 tokens on a Sapphire Rapids
    Xeon), else fp32 (with AVX512-BF16 alone that SDPA was several times slower on bf16 than converting)."""
    if dtype == torch.float32 or (device.type == "cpu" and has_amx_for(dtype)):
        return dtype
    return torch.float32


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """query ``[N, Q, H, D]``, key/value ``[N, L, KV, D]``, mask ``[N, 1, Q, L]`` (True = attend), or None for
    causal attention over ``L == Q`` keys → ``[N, Q, H, D]``, computed in ``_math_dtype``."""
    dtype = _math_dtype(query.dtype, query.device)
    return F.scaled_dot_product_attention(
        query.to(dtype).transpose(1, 2), key.to(dtype).transpose(1, 2), value.to(dtype).transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    ).transpose(1, 2).to(query.dtype)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """One query token per sequence ``[num_seqs, num_heads, head_dim]`` against its paged context.

    ``block_tables`` is ``[num_seqs, max_blocks]`` (padded with any value past each context),
    ``context_lens`` ``[num_seqs]`` counts the tokens to attend to, the new one included.
    ``plan`` is ``plan_decode`` of these same tables, when several layers share them.
    """
    if plan is None:
        plan = plan_decode(query, key_cache, value_cache, block_tables, context_lens)
    else:
        check_attention_inputs(query, key_cache, value_cache)
    return _attend_planned(query, key_cache, value_cache, plan, scale)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention for a flattened batch of new tokens against their paged context.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i + 1]``, which are the last tokens of its
    ``context_lens[i]`` tokens (their K/V already written into the cache). Token ``j`` of a
    sequence attends to every context position up to and including its own. ``plan`` is
    ``plan_prefill`` of these same tables, when several layers share them.
    """
    if plan is None:
        plan = plan_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    else:
        check_attention_inputs(query, key_cache, value_cache)
    return _attend_planned(query, key_cache, value_cache, plan, scale)


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


def compiles_on_first_launch() -> bool:
    """False: plain torch (the CPU backend's C++ kernels are built, or loaded, when it is selected)."""
    return False


def fused_layer_ops() -> ModuleType | None:
    """None: the reference runs the model's plain torch layers (token-exact with transformers)."""
    return None


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks from one cache tensor to another (device <-> CPU): ``dst[d] = src[s]``."""
    check_swap(src, dst, block_mapping)
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].to(device=src.device, dtype=torch.long)
    dst_ids = block_mapping[:, 1].to(device=dst.device, dtype=torch.long)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))
