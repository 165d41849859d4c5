"""Paged attention layer: writes the step's K/V into cache slots, then reads via block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_kernels.backend import KernelBackend, KernelPlan
from paged_kernels.checks import HostTables


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flattened batch; the first ``num_decode_tokens`` rows are decodes.

    The host copies (``slot_range``, ``*_host``) let the kernels check and plan without reading
    the device tensors back; ``None`` when a plan is given or the values may be read back.
    """

    slot_mapping: torch.Tensor
    slot_range: tuple[int, int]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    decode_host: HostTables | None
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_host: HostTables | None
    # the backend's plans for this step, made by the first layer and reused by the others
    decode_plan: KernelPlan | None = None
    prefill_plan: KernelPlan | None = None

    @property
    def has_prefill(self) -> bool:
        """True when some sequence computes more than one token this step."""
        return self.prefill_context_lens.numel() > 0


class PagedAttention:
    """Attention over the paged KV cache of one layer, dispatched to a kernel backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: KernelBackend) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = ops

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``query [T, H, D]``, ``key/value [T, KV, D]`` → attention output ``[T, H, D]``."""
        self.ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, meta.slot_range)
        num_decode = meta.num_decode_tokens
        if not meta.has_prefill:
            return self._decode(query, key_cache, value_cache, meta)
        prefill_args = (query[num_decode:], key_cache, value_cache, meta.prefill_block_tables,
                        meta.prefill_query_start_loc, meta.prefill_context_lens)
        if meta.prefill_plan is None:
            meta.prefill_plan = self.ops.plan_prefill(*prefill_args, host=meta.prefill_host)
        prefill = self.ops.paged_prefill_attention(*prefill_args, self.scale, plan=meta.prefill_plan)
        if num_decode == 0:
            return prefill
        return torch.cat([self._decode(query[:num_decode], key_cache, value_cache, meta), prefill])

    def _decode(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The decode rows' attention, planned once per step."""
        decode_args = (query, key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens)
        if meta.decode_plan is None:
            meta.decode_plan = self.ops.plan_decode(*decode_args, host=meta.decode_host)
        return self.ops.paged_attention_decode(*decode_args, self.scale, plan=meta.decode_plan)
