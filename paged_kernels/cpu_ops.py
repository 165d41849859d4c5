"""CPU backend: ``paged_kernels.reference`` with decode attention and the cache writes replaced by compiled kernels.

The kernel reads each sequence's K/V rows in place through its block table, where the reference gathers
every context into a fresh tensor per layer and then runs SDPA over it. Where the kernel cannot be built, decode
stays the reference's. With AMX tiles too the kernel is the faster one: torch's fused SDPA multiplies bf16 in tiles
there, but the gather before it costs more (decode steps 1.2-1.4x faster, 8-32 rows, on a Sapphire-Rapids-class
Xeon; BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from paged_kernels import reference
from paged_kernels.checks import HostTables, check_attention_inputs, check_cache_write, check_decode
from paged_kernels.cpu_extension import cpu_kernels
from paged_kernels.reference import (
    compiles_on_first_launch,
    copy_blocks,
    paged_prefill_attention,
    plan_decode_static,
    plan_prefill,
    swap_blocks,
)

__all__ = [
    "compiles_on_first_launch",
    "copy_blocks",
    "fused_layer_ops",
    "paged_attention_decode",
    "paged_prefill_attention",
    "plan_decode",
    "plan_decode_static",
    "plan_prefill",
    "reshape_and_cache",
    "swap_blocks",
]


def fused_layer_ops() -> ModuleType | None:
    """The compiled module's norm, rotary and SiLU ops (it holds the decode kernel too); None where it cannot
    be built."""
    return cpu_kernels()


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, slot_range: tuple[int, int] | None = None,
) -> None:
    """``paged_kernels.reference.reshape_and_cache``'s contract; rows in the caches' dtype (or fp32 rows for 16-bit
    caches) are written by the compiled kernel (a decode step's layer took 13 us in the reference's checks, views and
    two ``index_copy_``, 7 here, on a Zen 4)."""
    kernels = cpu_kernels()
    if (kernels is None or not runs_compiled(key, key_cache, value_cache)
            or key.stride(1) != key.shape[2] or value.stride(1) != value.shape[2]):
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, slot_range)
        return
    check_cache_write(key, value, key_cache, value_cache, slot_mapping, slot_range)
    kernels.write_kv_cache_(key, value, key_cache, value_cache, slot_mapping)


@dataclass(frozen=True, slots=True)
class CompiledDecodePlan:
    """The step's decode arguments were checked; the compiled kernel needs nothing else from the host."""

    num_queries: int


def reads_cache_dtype(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the compiled kernels take ``dtype`` rows (queries, new K/V) with a ``cache_dtype`` cache: the same
    dtype, or a 16-bit cache under fp32 rows (``EngineConfig.kv_cache_dtype``)."""
    return cache_dtype == dtype or (dtype == torch.float32 and cache_dtype in (torch.float16, torch.bfloat16))


def runs_compiled(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether decode over these tensors (or the cache write of ``query``'s rows) takes the compiled kernels."""
    return (query.device.type == "cpu" and key_cache.is_contiguous() and value_cache.is_contiguous()
            and reads_cache_dtype(query.dtype, key_cache.dtype) and cpu_kernels() is not None)


def plan_decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, host: HostTables | None = None,
) -> CompiledDecodePlan | reference.AttentionPlan:
    """Check the arguments of ``paged_attention_decode`` (from ``host`` when given) and plan it."""
    if not runs_compiled(query, key_cache, value_cache):
        return reference.plan_decode(query, key_cache, value_cache, block_tables, context_lens, host)
    check_decode(query, key_cache, value_cache, block_tables, context_lens, host)
    return CompiledDecodePlan(query.shape[0])


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: CompiledDecodePlan | reference.AttentionPlan | None = None,
) -> torch.Tensor:
    """``paged_kernels.reference.paged_attention_decode``'s contract, computed by the compiled kernel."""
    if plan is None:
        plan = plan_decode(query, key_cache, value_cache, block_tables, context_lens)
    if isinstance(plan, reference.AttentionPlan):
        return reference.paged_attention_decode(query, key_cache, value_cache, block_tables, context_lens, scale, plan)
    check_attention_inputs(query, key_cache, value_cache)
    if plan.num_queries != query.shape[0]:
        raise ValueError(f"plan covers {plan.num_queries} query rows, query has {query.shape[0]}")
    kernels = cpu_kernels()
    assert kernels is not None  # a CompiledDecodePlan is only made when the kernels load
    # the kernel reads the query rows at their stride and takes int32 tables as they are
    return kernels.paged_decode(query, key_cache, value_cache, block_tables, context_lens, scale)
